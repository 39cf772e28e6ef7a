// The W8A8 decode kernel's pieces (qgemv.cpp has the story): activations to int8 per block of 32, and the VNNI
// product of a range of 16-row weight tiles. qgemv.cpp's op runs them over all tiles in parallel; decode_step.cpp
// runs each thread's share of the tiles inside its one parallel region.
#pragma once
#include "common.h"

#include <type_traits>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define COMPRESS_VNNI 1
#include <immintrin.h>
#endif

namespace compress_cpu {

constexpr int64_t QB = 32;    // activation quantization block
constexpr int64_t MAXM = 8;  // rows of x per pass over the weights

// x [M, K] -> codes [M, K] int8, a scale per 32-block ([M, K/32]), and the sum of the dequantized activations
// over each weight group ([M, K/group])
template <typename T>
inline void quantize_rows(const T* x, int64_t m, int64_t k, int64_t group, int8_t* q, float* sa, float* gsum) {
  const int64_t nb = k / QB, ng = k / group, bpg = group / QB;
  for (int64_t r = 0; r < m; ++r) {
    const T* xr = x + r * k;
    for (int64_t b = 0; b < nb; ++b) {
      float amax = 0.f;
      for (int64_t i = 0; i < QB; ++i) amax = std::max(amax, std::fabs(ld(xr, b * QB + i)));
      const float s = amax / 127.f;
      const float inv = s > 0.f ? 1.f / s : 0.f;
      int32_t qsum = 0;
      for (int64_t i = 0; i < QB; ++i) {
        const int8_t v = static_cast<int8_t>(std::nearbyint(ld(xr, b * QB + i) * inv));
        q[r * k + b * QB + i] = v;
        qsum += v;
      }
      sa[r * nb + b] = s;
      if (b % bpg == 0) gsum[r * ng + b / bpg] = 0.f;
      gsum[r * ng + b / bpg] += s * static_cast<float>(qsum);
    }
  }
}

#ifdef COMPRESS_VNNI
// Output rows in tiles of 16, one per int32 lane: a weight vector holds 4 consecutive codes of each of 16 rows,
// and a broadcast of 4 activation codes meets it in one vpdpbusd, so a 32-block of 16 rows is 8 vpdpbusd into
// one int32 vector, converted and scaled once; no horizontal sums. Tiles in parallel. The group scales are fp16
// (vcvtph2ps, AVX512F), times 1 / unscale (w8a8.py's half_scales): the result is multiplied by unscale at the end.
template <int BITS, int M, bool LUT, typename T>
void gemv_tiles(const uint8_t* w, const uint16_t* scale, const uint16_t* szero, float unscale, const int8_t* xq,
                const float* sa, const float* gsum, const int32_t* gidx, const uint8_t* lut, T* out, int64_t k,
                int64_t n_out, int64_t group, int64_t t0, int64_t t1) {
  const int64_t nb = k / QB, ng = k / group, block_bytes = 16 * QB * BITS / 8;
  const __m512i mask = _mm512_set1_epi8(0x0F);
  // the 16-entry table in each 128-bit lane, as vpshufb indexes it per lane
  const __m512i table = LUT ? _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(lut)))
                            : _mm512_setzero_si512();
  for (int64_t t = t0; t < t1; ++t) {
    const uint8_t* wt = w + t * nb * block_bytes;
    const uint16_t* ts = scale + t * ng * 16;
    const uint16_t* tz = szero + t * ng * 16;
    __m512 acc[M];
#pragma GCC unroll 8
    for (int r = 0; r < M; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* wb = wt + b * block_bytes;
      __m512i lo_acc[M], hi_acc[M];  // two dependency chains
#pragma GCC unroll 8
      for (int r = 0; r < M; ++r) lo_acc[r] = hi_acc[r] = _mm512_setzero_si512();
#pragma GCC unroll 4
      for (int p = 0; p < 4; ++p) {
        if constexpr (BITS == 4) {  // 64 bytes: codes k = 8p..8p+3 (low nibbles) and 8p+4..8p+7 (high)
          const __m512i v = _mm512_loadu_si512(wb + p * 64);
          __m512i lo = _mm512_and_si512(v, mask), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
          if constexpr (LUT) {
            lo = _mm512_shuffle_epi8(table, lo);
            hi = _mm512_shuffle_epi8(table, hi);
          }
#pragma GCC unroll 8
          for (int r = 0; r < M; ++r) {
            const int32_t* xr = reinterpret_cast<const int32_t*>(xq + r * k + b * QB) + 2 * p;
            lo_acc[r] = _mm512_dpbusd_epi32(lo_acc[r], lo, _mm512_set1_epi32(xr[0]));
            hi_acc[r] = _mm512_dpbusd_epi32(hi_acc[r], hi, _mm512_set1_epi32(xr[1]));
          }
        } else {  // 2 x 64 bytes: codes k = 8p..8p+3, then 8p+4..8p+7
          const __m512i v0 = _mm512_loadu_si512(wb + p * 128), v1 = _mm512_loadu_si512(wb + p * 128 + 64);
#pragma GCC unroll 8
          for (int r = 0; r < M; ++r) {
            const int32_t* xr = reinterpret_cast<const int32_t*>(xq + r * k + b * QB) + 2 * p;
            lo_acc[r] = _mm512_dpbusd_epi32(lo_acc[r], v0, _mm512_set1_epi32(xr[0]));
            hi_acc[r] = _mm512_dpbusd_epi32(hi_acc[r], v1, _mm512_set1_epi32(xr[1]));
          }
        }
      }
      const __m512 sv = half16(ts + gidx[b] * 16);
#pragma GCC unroll 8
      for (int r = 0; r < M; ++r) {
        const __m512 d = _mm512_cvtepi32_ps(_mm512_add_epi32(lo_acc[r], hi_acc[r]));
        acc[r] = _mm512_fmadd_ps(d, _mm512_mul_ps(sv, _mm512_set1_ps(sa[r * nb + b])), acc[r]);
      }
    }
    for (int64_t g = 0; g < ng; ++g) {
      const __m512 zv = half16(tz + g * 16);
#pragma GCC unroll 8
      for (int r = 0; r < M; ++r) acc[r] = _mm512_fnmadd_ps(zv, _mm512_set1_ps(gsum[r * ng + g]), acc[r]);
    }
    const int64_t rows = std::min<int64_t>(16, n_out - t * 16);
    alignas(64) float y[16];
    for (int r = 0; r < M; ++r) {
      _mm512_store_ps(y, _mm512_mul_ps(acc[r], _mm512_set1_ps(unscale)));
      for (int64_t i = 0; i < rows; ++i) st(out, r * n_out + t * 16 + i, y[i]);
    }
  }
}
#endif

inline bool has_vnni() {
#ifdef COMPRESS_VNNI
  return true;
#else
  return false;
#endif
}

// A packed weight as the kernel reads it (qmatmul.py's pack_tiles layout; see w8a8_linear in qgemv.cpp)
struct QWeight {
  const uint8_t* w;
  const uint16_t* scale;  // fp16 bits [tiles, K / group, 16], times 1 / unscale
  const uint16_t* szero;  // scale * zero, same layout and factor
  float unscale;          // a power of two (w8a8.py's half_scales)
  const uint8_t* lut;     // 4-bit codes' 16-entry table, or nullptr
  int64_t bits, group, k, n_out, tiles;
};

// out rows [M, n_out] (tiles [t0, t1) of them) <- xq [M, K] codes with their block scales sa [M, K/32] and group
// sums gsum [M, K/group] (quantize_rows); gidx [K/32]: each block's weight group. Rows in passes of up to MAXM.
template <typename T>
void gemv_range(const QWeight& q, const int8_t* xq, const float* sa, const float* gsum, const int32_t* gidx, T* out,
                int64_t m, int64_t t0, int64_t t1) {
#ifdef COMPRESS_VNNI
  const int64_t nb = q.k / QB, ng = q.k / q.group;
  for (int64_t r0 = 0; r0 < m; r0 += MAXM) {
    const int64_t mr = std::min(MAXM, m - r0);
    auto run = [&](auto bits_c, auto lut_c, auto m_c) {
      gemv_tiles<decltype(bits_c)::value, decltype(m_c)::value, decltype(lut_c)::value, T>(
          q.w, q.scale, q.szero, q.unscale, xq + r0 * q.k, sa + r0 * nb, gsum + r0 * ng, gidx, q.lut,
          out + r0 * q.n_out, q.k, q.n_out, q.group, t0, t1);
    };
    auto with_m = [&](auto bits_c, auto lut_c) {
      switch (mr) {
        case 1: return run(bits_c, lut_c, std::integral_constant<int, 1>{});
        case 2: return run(bits_c, lut_c, std::integral_constant<int, 2>{});
        case 3: return run(bits_c, lut_c, std::integral_constant<int, 3>{});
        case 4: return run(bits_c, lut_c, std::integral_constant<int, 4>{});
        case 5: return run(bits_c, lut_c, std::integral_constant<int, 5>{});
        case 6: return run(bits_c, lut_c, std::integral_constant<int, 6>{});
        case 7: return run(bits_c, lut_c, std::integral_constant<int, 7>{});
        default: return run(bits_c, lut_c, std::integral_constant<int, 8>{});
      }
    };
    if (q.bits == 8)
      with_m(std::integral_constant<int, 8>{}, std::false_type{});
    else if (q.lut != nullptr)
      with_m(std::integral_constant<int, 4>{}, std::true_type{});
    else
      with_m(std::integral_constant<int, 4>{}, std::false_type{});
  }
#endif
}

}  // namespace compress_cpu
