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
//
// An 8-bit cache (runtime/kernels/kv_quant.py: int8 or fp8 e4m3 codes, one fp16 scale per token and KV head)
// is read as codes and dequantized in registers: a key's dot product runs over its codes and is scaled once,
// a value's codes are added with the probability times its scale. write_kv_q8_ quantizes new tokens the way
// quantize_kv does, bit for bit (the same fp32 divisions and roundings).
//
// A softcap > 0 (Gemma 2's attn_logit_softcapping) bounds each score s = scale * q.k to tanh(s / cap) * cap
// before the softmax, as the torch path does.
#include "common.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

using namespace compress_cpu;

constexpr int64_t kChunkKeys = 128;        // the fewest keys a split of a long sequence gets
constexpr int64_t kInlineWork = 1 << 18;   // fewer query-head x key x dim products than this: one thread
constexpr int64_t kAhead = 16;             // keys prefetched ahead

using Fp8 = c10::Float8_e4m3fn;

// every fp8 e4m3 code's value, indexed by its bits
const float* fp8_table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int i = 0; i < 256; ++i) t[i] = static_cast<float>(Fp8(static_cast<uint8_t>(i), Fp8::from_bits()));
    return t;
  }();
  return table.data();
}

using compress_cpu::ld;  // the float and bf16 overloads, beside these two
inline float ld(const int8_t* p, int64_t i) { return static_cast<float>(p[i]); }
inline float ld(const Fp8* p, int64_t i) { return fp8_table()[reinterpret_cast<const uint8_t*>(p)[i]]; }

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 load16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline __m512 load16(const Fp8* p) {
  const __m512i idx = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm512_i32gather_ps(idx, fp8_table(), 4);
}
#endif

// the scale of a cache of codes C: fp16 for 8-bit codes, none (1) for a cache in the compute dtype
template <typename C>
constexpr bool kCoded = std::is_same_v<C, int8_t> || std::is_same_v<C, Fp8>;
template <typename C>
inline float row_scale(const at::Half* scales, int64_t i) {
  if constexpr (kCoded<C>) return static_cast<float>(scales[i]);
  return 1.f;
}

template <typename C>
inline float dot(const float* q, const C* k, int64_t d) {
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

template <typename C>
inline void axpy(float p, const C* v, float* acc, int64_t d) {  // acc += p * v
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
  float scale, softcap;  // softcap <= 0: none
  const int32_t* tables;
  const int32_t* lens;
  int64_t start(int64_t b) const { return window > 0 ? std::max<int64_t>(0, lens[b] - window) : 0; }
};

// One unit's softmax statistics and value sums, per query head: stats = [max (Hq), sum (Hq), acc (Hq x D)].
// A key's heads sit side by side in the cache ([.., block, Hkv, D]), so every head is done in one pass over
// the unit's keys: each token's row is read once, whole, and the reads stream.
template <typename T, typename C>
void attend(const Unit& u, const Problem& p, const T* q, const C* kc, const C* vc, const at::Half* ks,
            const at::Half* vs, float* stats, std::vector<float>& qf, std::vector<float>& scores,
            std::vector<int64_t>& rows) {
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
      rows[j] = (base + t) * p.hkv;  // the token's first head: codes at rows[j] * d, scales at rows[j]
  }
  // blocks sit anywhere and are usually cold (the other layers' weights went through the caches since):
  // fetch keys and values a few tokens ahead
  const int64_t row_bytes = p.hkv * d * static_cast<int64_t>(sizeof(C));
  auto fetch = [&](int64_t j) {
    for (int64_t o = 0; o < row_bytes; o += 64) {
      __builtin_prefetch(reinterpret_cast<const char*>(kc + rows[j] * d) + o);
      __builtin_prefetch(reinterpret_cast<const char*>(vc + rows[j] * d) + o);
    }
  };
  for (int64_t j = 0; j < std::min(kAhead, n); ++j) fetch(j);
  for (int64_t j = 0; j < n; ++j) {
    if (j + kAhead < n) fetch(j + kAhead);
    for (int64_t h = 0; h < hq; ++h) {
      const int64_t r = rows[j] + h / group;
      scores[h * n + j] = dot(qf.data() + h * d, kc + r * d, d) * (row_scale<C>(ks, r) * p.scale);
    }
  }
  if (p.softcap > 0.f) {
    const float cap = p.softcap;
    for (int64_t i = 0; i < hq * n; ++i) scores[i] = std::tanh(scores[i] / cap) * cap;
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
    for (int64_t h = 0; h < hq; ++h) {
      const int64_t r = rows[j] + h / group;
      axpy(scores[h * n + j] * row_scale<C>(vs, r), vc + r * d, acc + h * d, d);
    }
}

template <typename T, typename C>
void decode_attention_kernel(const Problem& p, const T* q, const C* kc, const C* vc, const at::Half* ks,
                             const at::Half* vs, T* out, int64_t b_count) {
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
    for (int64_t i = begin; i < end; ++i)
      attend(units[i], p, q, kc, vc, ks, vs, stats.data() + i * stride, qf, scores, rows);
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

// Calls f(C{}) with C the cache's code type: int8, fp8 e4m3, or T itself (a cache in the compute dtype)
template <typename T, typename F>
void dispatch_codes(const at::Tensor& cache, bool scaled, F&& f) {
  const auto type = cache.scalar_type();
  TORCH_CHECK(scaled == (type == at::kChar || type == at::kFloat8_e4m3fn), "an int8 or fp8_e4m3 cache needs its "
              "fp16 scales (and only such a cache has them); got a ", type, " cache ", scaled ? "with" : "without",
              " scales");
  if (type == at::kChar) {
    f(int8_t{});
  } else if (type == at::kFloat8_e4m3fn) {
    f(Fp8{});
  } else {
    TORCH_CHECK(type == c10::CppTypeToScalarType<T>::value, "q and the caches must share a dtype");
    f(T{});
  }
}

void check_scales(const at::Tensor& scales, const at::Tensor& cache, const char* name) {
  check_cpu(scales, name);
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.dim() == 3 && scales.size(0) == cache.size(0) &&
              scales.size(1) == cache.size(1) && scales.size(2) == cache.size(2),
              name, " must be fp16 [blocks, block, Hkv], parallel to the cache");
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                                  int64_t window, const std::optional<at::Tensor>& k_scale,
                                  const std::optional<at::Tensor>& v_scale, double softcap) {
  TORCH_CHECK(q.device().is_cpu() && q.dim() == 3 && q.stride(2) == 1, "q must be a CPU [B, Hq, D] tensor, "
              "contiguous in D");
  check_cpu(k_cache, "k_cache");
  check_cpu(v_cache, "v_cache");
  check_cpu(block_tables, "block_tables");
  check_cpu(seq_lens, "seq_lens");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes() &&
              v_cache.scalar_type() == k_cache.scalar_type(), "caches must be [blocks, block, Hkv, D], of one dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt,
              "block_tables and seq_lens must be int32");
  const bool scaled = k_scale.has_value();
  TORCH_CHECK(scaled == v_scale.has_value(), "give both k_scale and v_scale, or neither");
  if (scaled) {
    check_scales(*k_scale, k_cache, "k_scale");
    check_scales(*v_scale, v_cache, "v_scale");
  }
  const int64_t b = q.size(0), hq = q.size(1), d = q.size(2), hkv = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == d && hq % hkv == 0 && d <= 1024, "head_dim (<= 1024) or head counts do not "
              "match the cache");
  TORCH_CHECK(block_tables.size(0) == b && seq_lens.numel() == b, "one table row and length per sequence");
  auto out = at::empty({b, hq, d}, q.options());
  if (b == 0) return out;
  const Problem p{q.stride(0), q.stride(1), hq, hkv, d, k_cache.size(1), block_tables.size(1), window,
                  static_cast<float>(scale), static_cast<float>(softcap), block_tables.data_ptr<int32_t>(),
                  seq_lens.data_ptr<int32_t>()};
  const at::Half* ks = scaled ? k_scale->data_ptr<at::Half>() : nullptr;
  const at::Half* vs = scaled ? v_scale->data_ptr<at::Half>() : nullptr;
  DISPATCH_F32_BF16(q.scalar_type(), "paged_decode_attention", [&] {
    dispatch_codes<scalar_t>(k_cache, scaled, [&](auto code) {
      using C = decltype(code);
      decode_attention_kernel<scalar_t, C>(p, q.data_ptr<scalar_t>(), static_cast<const C*>(k_cache.data_ptr()),
                                           static_cast<const C*>(v_cache.data_ptr()), ks, vs,
                                           out.data_ptr<scalar_t>(), b);
    });
  });
  return out;
}

// one token-head row x [D] -> codes and fp16 scale, as quantize_kv computes them (same fp32 operations)
template <typename T, typename C>
void quantize_row(const T* x, int64_t d, C* codes, at::Half* scale) {
  constexpr float qmax = std::is_same_v<C, int8_t> ? 127.f : 448.f;
  float amax = 0.f;
  for (int64_t i = 0; i < d; ++i) amax = std::max(amax, std::fabs(ld(x, i)));
  const at::Half s16(std::min(amax / qmax, 65504.f));
  const float s = static_cast<float>(s16), div = s > 0.f ? s : 1.f;
  for (int64_t i = 0; i < d; ++i) {
    const float y = std::min(std::max(ld(x, i) / div, -qmax), qmax);
    if constexpr (std::is_same_v<C, int8_t>) {
      codes[i] = static_cast<int8_t>(std::nearbyint(y));  // half to even, as torch.round
    } else {
      codes[i] = Fp8(y);
    }
  }
  *scale = s16;
}

// 8-bit caches [blocks, block, Hkv, D] and their scales [blocks, block, Hkv] at `slots` [T] <- k, v [T, Hkv, D]
void write_kv_q8_(at::Tensor k_cache, at::Tensor v_cache, at::Tensor k_scale, at::Tensor v_scale, const at::Tensor& k,
                  const at::Tensor& v, const at::Tensor& slots) {
  check_cpu(k_cache, "k_cache");
  check_cpu(v_cache, "v_cache");
  check_cpu(slots, "slots");
  check_scales(k_scale, k_cache, "k_scale");
  check_scales(v_scale, v_cache, "v_scale");
  const int64_t t = k.size(0), hkv = k_cache.size(2), d = k_cache.size(3);
  for (const at::Tensor* x : {&k, &v})
    TORCH_CHECK(x->device().is_cpu() && x->dim() == 3 && x->size(0) == t && x->size(1) == hkv && x->size(2) == d &&
                x->stride(2) == 1 && x->stride(1) == d && x->scalar_type() == k.scalar_type(),
                "k and v must be [T, Hkv, D] with each token's heads contiguous, of one dtype");
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes() && v_cache.scalar_type() == k_cache.scalar_type(),
              "k_cache and v_cache must match");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.numel() == t, "slots: int64, one per token");
  const int64_t capacity = k_cache.size(0) * k_cache.size(1);
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < t; ++i) TORCH_CHECK(sp[i] >= 0 && sp[i] < capacity, "slot ", sp[i], " is outside the cache");
  DISPATCH_F32_BF16(k.scalar_type(), "write_kv_q8_", [&] {
    dispatch_codes<scalar_t>(k_cache, true, [&](auto code) {
      using C = decltype(code);
      if constexpr (kCoded<C>) {
        for (int64_t i = 0; i < t; ++i)
          for (int64_t h = 0; h < hkv; ++h) {
            const int64_t r = sp[i] * hkv + h;
            quantize_row(k.data_ptr<scalar_t>() + i * k.stride(0) + h * d, d,
                         static_cast<C*>(k_cache.data_ptr()) + r * d, k_scale.data_ptr<at::Half>() + r);
            quantize_row(v.data_ptr<scalar_t>() + i * v.stride(0) + h * d, d,
                         static_cast<C*>(v_cache.data_ptr()) + r * d, v_scale.data_ptr<at::Half>() + r);
          }
      }
    });
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(compress_cpu, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens, "
        "float scale, int window, Tensor? k_scale=None, Tensor? v_scale=None, float softcap=0.0) -> Tensor", &paged_decode_attention);
  m.def("write_kv_q8_(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor(c!) k_scale, Tensor(d!) v_scale, Tensor k, "
        "Tensor v, Tensor slots) -> ()", &write_kv_q8_);
}
