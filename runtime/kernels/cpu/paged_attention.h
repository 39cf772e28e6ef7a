// Decode attention's pieces over the paged KV cache (decode_attention.cpp has the story): a call is cut into
// units (a sequence's keys, or a chunk of them, for some of its KV heads), each unit keeps its own softmax
// statistics, and the units of each (sequence, head) merge at the end. decode_attention.cpp's op runs the units
// with parallel_for; decode_step.cpp shares them among the threads of its one parallel region.
#pragma once
#include "common.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace compress_cpu {

constexpr int64_t kChunkKeys = 128;        // the fewest keys a split of a long sequence gets
constexpr int64_t kInlineWork = 1 << 18;   // fewer query-head x key x dim products than this: one thread
constexpr int64_t kAhead = 16;             // keys prefetched ahead

using Fp8 = c10::Float8_e4m3fn;

// every fp8 e4m3 code's value, indexed by its bits
inline const float* fp8_table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int i = 0; i < 256; ++i) t[i] = static_cast<float>(Fp8(static_cast<uint8_t>(i), Fp8::from_bits()));
    return t;
  }();
  return table.data();
}

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

struct Unit {  // keys [j0, j1) of sequence b's window, KV heads [g0, g1) and their query heads
  int64_t b, j0, j1;
  bool whole;  // the unit is the sequence's whole window: its probabilities are final
  int64_t g0, g1;
};

struct Problem {
  int64_t q_row, q_head, hq, hkv, d, block_size, width, window;
  float scale, softcap;  // softcap <= 0: none
  const int32_t* tables;
  const int32_t* lens;
  int64_t start(int64_t b) const { return window > 0 ? std::max<int64_t>(0, lens[b] - window) : 0; }
};

// One unit's softmax statistics and value sums, per query head of the unit (the others untouched):
// stats = [max (Hq), sum (Hq), acc (Hq x D)].
// A key's heads sit side by side in the cache ([.., block, Hkv, D]), so every head is done in one pass over
// the unit's keys: each token's row is read once, whole, and the reads stream.
template <typename T, typename C>
inline void attend(const Unit& u, const Problem& p, const T* q, const C* kc, const C* vc, const at::Half* ks,
            const at::Half* vs, float* stats, std::vector<float>& qf, std::vector<float>& scores,
            std::vector<int64_t>& rows) {
  const int64_t hq = p.hq, group = hq / p.hkv, d = p.d, n = u.j1 - u.j0, h0 = u.g0 * group, h1 = u.g1 * group;
  float *mx = stats, *sum = stats + hq, *acc = stats + 2 * hq;
  qf.resize(hq * d);
  scores.resize(hq * n);
  rows.resize(n);
  for (int64_t h = h0; h < h1; ++h)
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
    for (int64_t h = h0; h < h1; ++h) {
      const int64_t r = rows[j] + h / group;
      scores[h * n + j] = dot(qf.data() + h * d, kc + r * d, d) * (row_scale<C>(ks, r) * p.scale);
    }
  }
  if (p.softcap > 0.f) {
    const float cap = p.softcap;
    for (int64_t i = h0 * n; i < h1 * n; ++i) scores[i] = std::tanh(scores[i] / cap) * cap;
  }
  for (int64_t h = h0; h < h1; ++h) {
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
  std::fill(acc + h0 * d, acc + h1 * d, 0.f);
  for (int64_t j = 0; j < n; ++j)
    for (int64_t h = h0; h < h1; ++h) {
      const int64_t r = rows[j] + h / group;
      axpy(scores[h * n + j] * row_scale<C>(vs, r), vc + r * d, acc + h * d, d);
    }
}

struct Plan {
  std::vector<Unit> units;
  std::vector<int64_t> first;  // units of sequence b are [first[b], first[b + 1])
  bool small;                  // too little work to share out across a fork (the op runs it on one thread)
};

// The units of a call over b_count sequences for `threads` threads: small calls (fewer than kInlineWork products)
// keep each sequence whole, large ones split each sequence's keys into chunks of at least kChunkKeys; with
// split_heads (threads that are already running: no fork to pay) the KV heads are also shared out until every
// thread has a unit.
inline Plan plan_units(const Problem& p, int64_t b_count, int64_t threads, bool split_heads) {
  int64_t work = 0;
  for (int64_t b = 0; b < b_count; ++b) work += (p.lens[b] - p.start(b)) * p.hq * p.d;
  Plan plan;
  plan.small = work < kInlineWork || threads == 1;
  plan.first.assign(b_count + 1, 0);
  for (int64_t b = 0; b < b_count; ++b) {
    const int64_t n = p.lens[b] - p.start(b);
    int64_t splits = 1;
    if (!plan.small) {  // enough units for every thread, none shorter than kChunkKeys
      const int64_t wanted = (2 * threads + b_count - 1) / b_count;
      splits = std::max<int64_t>(1, std::min(wanted, n / kChunkKeys));
    }
    int64_t heads = 1;
    if (split_heads)  // KV-head groups until the units cover the threads
      heads = std::min(p.hkv, std::max<int64_t>(1, (threads + b_count * splits - 1) / (b_count * splits)));
    for (int64_t g = 0; g < heads; ++g)
      for (int64_t s = 0; s < splits; ++s)
        plan.units.push_back({b, n * s / splits, n * (s + 1) / splits, splits == 1, p.hkv * g / heads,
                              p.hkv * (g + 1) / heads});
    plan.first[b + 1] = static_cast<int64_t>(plan.units.size());
  }
  return plan;
}

// out[b, h] (D values) from the statistics of sequence b's units that hold query head h; o: fp32 scratch [D]
template <typename T>
inline void merge_head(const Problem& p, const Plan& plan, const float* stats, int64_t b, int64_t h, T* out,
                       float* o) {
  const int64_t hq = p.hq, d = p.d, stride = hq * (d + 2), g = h / (hq / p.hkv);
  int64_t count = 0;
  float m = -INFINITY, total = 0.f;
  for (int64_t u = plan.first[b]; u < plan.first[b + 1]; ++u)
    if (plan.units[u].g0 <= g && g < plan.units[u].g1) {
      m = std::max(m, stats[u * stride + h]);
      ++count;
    }
  std::fill(o, o + d, 0.f);
  for (int64_t u = plan.first[b]; u < plan.first[b + 1]; ++u) {
    if (!(plan.units[u].g0 <= g && g < plan.units[u].g1)) continue;
    const float* st_u = stats + u * stride;
    const float w = count == 1 ? 1.f : vexp(st_u[h] - m);
    total += w * st_u[hq + h];
    axpy(w, st_u + 2 * hq + h * d, o, d);
  }
  const float inv = count == 1 ? 1.f : 1.f / total;
  for (int64_t i = 0; i < d; ++i) st(out, (b * hq + h) * d + i, o[i] * inv);
}

// Calls f(C{}) with C the cache's code type: int8, fp8 e4m3, or T itself (a cache in the compute dtype)
template <typename T, typename F>
inline void dispatch_codes(const at::Tensor& cache, bool scaled, F&& f) {
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

// one token-head row x [D] -> codes and fp16 scale, as quantize_kv computes them (same fp32 operations)
template <typename T, typename C>
inline void quantize_row(const T* x, int64_t d, C* codes, at::Half* scale) {
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

}  // namespace compress_cpu
