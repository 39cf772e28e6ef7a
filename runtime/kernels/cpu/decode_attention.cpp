// Decode attention over the paged KV cache on CPU: one new query per sequence (runtime/kernels/cpu_ext.py
// builds and loads this with the other kernels).
//
// The work of a decode step is tiny at batch 1 (SmolLM2, 140 keys: ~80k products per layer), so the cost is
// in how it is spread: a parallel region over 3 KV heads on 2 threads waits for the slower thread and pays
// the fork and join, which made this op 2x slower than one thread doing it all. Small calls therefore run
// inline; large ones split each sequence's keys into chunks ("flash decoding"), each chunk keeps its own
// softmax max and sum, and the chunks merge at the end, so a single long sequence uses every thread.
// Softmax in fp32; a sequence that is one chunk normalizes its probabilities before the value sum, as the
// torch reference does.
#include "common.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

using namespace compress_cpu;

constexpr int64_t kChunkKeys = 128;        // the fewest keys a split of a long sequence gets
constexpr int64_t kInlineWork = 1 << 18;   // fewer query-head x key x dim products than this: one thread
constexpr int64_t kAhead = 16;             // keys prefetched ahead

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#endif

template <typename T>
inline float dot(const float* q, const T* k, int64_t d) {
  int64_t i = 0;
  float s = 0.f;
#if defined(__AVX512F__)
  __m512 acc = _mm512_setzero_ps();
  for (; i + 16 <= d; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + i), load16(k + i), acc);
  s = _mm512_reduce_add_ps(acc);
#endif
  for (; i < d; ++i) s += q[i] * ld(k, i);
  return s;
}

template <typename T>
inline void axpy(float p, const T* v, float* acc, int64_t d) {  // acc += p * v
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 pv = _mm512_set1_ps(p);
  for (; i + 16 <= d; i += 16) _mm512_storeu_ps(acc + i, _mm512_fmadd_ps(pv, load16(v + i), _mm512_loadu_ps(acc + i)));
#endif
  for (; i < d; ++i) acc[i] += p * ld(v, i);
}

struct Unit {  // keys [j0, j1) of sequence b's window, all heads
  int64_t b, j0, j1;
  bool whole;  // the unit is the sequence's whole window: its probabilities are final
};

struct Problem {
  int64_t q_row, q_head, hq, hkv, d, block_size, width, window;
  float scale;
  const int32_t* tables;
  const int32_t* lens;
  int64_t start(int64_t b) const { return window > 0 ? std::max<int64_t>(0, lens[b] - window) : 0; }
};

// One unit's softmax statistics and value sums, per query head: stats = [max (Hq), sum (Hq), acc (Hq x D)].
// A key's heads sit side by side in the cache ([.., block, Hkv, D]), so every head is done in one pass over
// the unit's keys: each token's row is read once, whole, and the reads stream.
template <typename T>
void attend(const Unit& u, const Problem& p, const T* q, const T* kc, const T* vc, float* stats,
            std::vector<float>& qf, std::vector<float>& scores, std::vector<int64_t>& rows) {
  const int64_t hq = p.hq, group = hq / p.hkv, d = p.d, n = u.j1 - u.j0;
  float *mx = stats, *sum = stats + hq, *acc = stats + 2 * hq;
  qf.resize(hq * d);
  scores.resize(hq * n);
  rows.resize(n);
  for (int64_t h = 0; h < hq; ++h)
    for (int64_t i = 0; i < d; ++i) qf[h * d + i] = ld(q, u.b * p.q_row + h * p.q_head + i);
  const int32_t* table = p.tables + u.b * p.width;
  const int64_t first = p.start(u.b) + u.j0;  // walk the block table once: no integer division per key
  for (int64_t blk = first / p.block_size, j = 0; j < n; ++blk) {
    const int64_t base = static_cast<int64_t>(table[blk]) * p.block_size;
    for (int64_t t = (j == 0 ? first % p.block_size : 0); t < p.block_size && j < n; ++t, ++j)
      rows[j] = (base + t) * p.hkv * d;
  }
  // blocks sit anywhere and are usually cold (the other layers' weights went through the caches since):
  // fetch keys and values a few tokens ahead
  const int64_t row_bytes = p.hkv * d * static_cast<int64_t>(sizeof(T));
  auto fetch = [&](int64_t j) {
    for (int64_t o = 0; o < row_bytes; o += 64) {
      __builtin_prefetch(reinterpret_cast<const char*>(kc + rows[j]) + o);
      __builtin_prefetch(reinterpret_cast<const char*>(vc + rows[j]) + o);
    }
  };
  for (int64_t j = 0; j < std::min(kAhead, n); ++j) fetch(j);
  for (int64_t j = 0; j < n; ++j) {
    if (j + kAhead < n) fetch(j + kAhead);
    for (int64_t h = 0; h < hq; ++h)
      scores[h * n + j] = dot(qf.data() + h * d, kc + rows[j] + (h / group) * d, d) * p.scale;
  }
  for (int64_t h = 0; h < hq; ++h) {
    float* s = scores.data() + h * n;
    const float m = *std::max_element(s, s + n);
    float total = 0.f;
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) s[j] = vexp(s[j] - m);
    for (int64_t j = 0; j < n; ++j) total += s[j];
    if (u.whole) {
      const float inv = 1.f / total;
      for (int64_t j = 0; j < n; ++j) s[j] *= inv;
      total = 1.f;
    }
    mx[h] = m;
    sum[h] = total;
  }
  std::fill(acc, acc + hq * d, 0.f);
  for (int64_t j = 0; j < n; ++j)
    for (int64_t h = 0; h < hq; ++h) axpy(scores[h * n + j], vc + rows[j] + (h / group) * d, acc + h * d, d);
}

template <typename T>
void decode_attention_kernel(const Problem& p, const T* q, const T* kc, const T* vc, T* out, int64_t b_count) {
  const int64_t hq = p.hq, d = p.d, stride = hq * (d + 2);
  int64_t work = 0;
  for (int64_t b = 0; b < b_count; ++b) work += (p.lens[b] - p.start(b)) * hq * d;
  const int64_t threads = at::get_num_threads();
  const bool inline_ = work < kInlineWork || threads == 1;
  std::vector<Unit> units;
  std::vector<int64_t> first(b_count + 1, 0);  // units of sequence b are [first[b], first[b + 1])
  for (int64_t b = 0; b < b_count; ++b) {
    const int64_t n = p.lens[b] - p.start(b);
    int64_t splits = 1;
    if (!inline_) {  // enough units for every thread, none shorter than kChunkKeys
      const int64_t wanted = (2 * threads + b_count - 1) / b_count;
      splits = std::max<int64_t>(1, std::min(wanted, n / kChunkKeys));
    }
    for (int64_t s = 0; s < splits; ++s) units.push_back({b, n * s / splits, n * (s + 1) / splits, splits == 1});
    first[b + 1] = static_cast<int64_t>(units.size());
  }
  std::vector<float> stats(units.size() * stride);
  const int64_t n_units = static_cast<int64_t>(units.size());
  at::parallel_for(0, n_units, inline_ ? n_units + 1 : 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf, scores;
    std::vector<int64_t> rows;
    for (int64_t i = begin; i < end; ++i) attend(units[i], p, q, kc, vc, stats.data() + i * stride, qf, scores, rows);
  });
  float o[1024];  // d <= 1024 (checked)
  for (int64_t b = 0; b < b_count; ++b) {  // merge the chunks of each sequence
    const int64_t u0 = first[b], u1 = first[b + 1];
    for (int64_t h = 0; h < hq; ++h) {
      float m = -INFINITY, total = 0.f;
      for (int64_t u = u0; u < u1; ++u) m = std::max(m, stats[u * stride + h]);
      std::fill(o, o + d, 0.f);
      for (int64_t u = u0; u < u1; ++u) {
        const float* st_u = stats.data() + u * stride;
        const float w = u1 - u0 == 1 ? 1.f : vexp(st_u[h] - m);
        total += w * st_u[hq + h];
        axpy(w, st_u + 2 * hq + h * d, o, d);
      }
      const float inv = u1 - u0 == 1 ? 1.f : 1.f / total;
      for (int64_t i = 0; i < d; ++i) st(out, (b * hq + h) * d + i, o[i] * inv);
    }
  }
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                                  int64_t window) {
  TORCH_CHECK(q.device().is_cpu() && q.dim() == 3 && q.stride(2) == 1, "q must be a CPU [B, Hq, D] tensor, "
              "contiguous in D");
  check_cpu(k_cache, "k_cache");
  check_cpu(v_cache, "v_cache");
  check_cpu(block_tables, "block_tables");
  check_cpu(seq_lens, "seq_lens");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "caches must be [blocks, block, Hkv, D]");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt,
              "block_tables and seq_lens must be int32");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type(),
              "q and the caches must share a dtype");
  const int64_t b = q.size(0), hq = q.size(1), d = q.size(2), hkv = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == d && hq % hkv == 0 && d <= 1024, "head_dim (<= 1024) or head counts do not "
              "match the cache");
  TORCH_CHECK(block_tables.size(0) == b && seq_lens.numel() == b, "one table row and length per sequence");
  auto out = at::empty({b, hq, d}, q.options());
  if (b == 0) return out;
  const Problem p{q.stride(0), q.stride(1), hq, hkv, d, k_cache.size(1), block_tables.size(1), window,
                  static_cast<float>(scale), block_tables.data_ptr<int32_t>(), seq_lens.data_ptr<int32_t>()};
  DISPATCH_F32_BF16(q.scalar_type(), "paged_decode_attention", [&] {
    decode_attention_kernel<scalar_t>(p, q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(),
                                      v_cache.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), b);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(compress_cpu, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens, "
        "float scale, int window) -> Tensor", &paged_decode_attention);
}
