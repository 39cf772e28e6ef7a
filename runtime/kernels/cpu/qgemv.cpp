// Integer weights times int8-quantized activations for the decode step (a few rows per call), on AVX512-VNNI.
//
// At batch 1 each weight byte is used once per token, so a linear is a matter of reading its bytes fast and
// spending few instructions per byte. Converting 4-bit weights to floats (aten's int4pack kernel) costs
// more instructions than the bytes cost time. Here, as in llama.cpp's Q4 x Q8 dot products, the activations
// are quantized once per call to int8 in blocks of 32 (scale = max|x| / 127, round to nearest even), and
// one vpdpbusd multiplies 64 unsigned weight codes by 64 signed activation codes into 16 int32 sums. Per
// 32-block the int32 sums become fp32, scaled by (weight group scale x activation block scale). The zero
// point uses the sum of the same rounded activations over each weight group, so that the result is exactly
// the dot product of the dequantized weights with the dequantized activations (the rounding error of x meets
// q - z, not the larger q):
//     y[n] = sum_b s[n,g(b)] * sa[b] * <q[n,b], xq[b]>  -  sum_g s[n,g] * z[n,g] * sum_{b in g} sa[b] * sum(xq[b])
// runtime/kernels/w8a8.py packs the weights (pack_tiles) and holds the torch reference (w8a8_reference).
// A table (LUT) maps 4-bit codes to 8-bit ones in the register (vpshufb) before the dot products: NF4 codes
// become round(127 * NF4[q]) + 128 with zero point 128 and scale / 127, so nf4 reads 4 bits a weight like int4.
#include "common.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <optional>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define COMPRESS_VNNI 1
#include <immintrin.h>
#endif

namespace {

using namespace compress_cpu;

constexpr int64_t QB = 32;    // activation quantization block
constexpr int64_t MAXM = 8;  // rows of x per pass over the weights

// x [M, K] -> codes [M, K] int8, a scale per 32-block ([M, K/32]), and the sum of the dequantized activations
// over each weight group ([M, K/group])
template <typename T>
void quantize_rows(const T* x, int64_t m, int64_t k, int64_t group, int8_t* q, float* sa, float* gsum) {
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
// one int32 vector, converted and scaled once; no horizontal sums. Tiles in parallel.
template <int BITS, int M, bool LUT, typename T>
void gemv_tiles(const uint8_t* w, const float* scale, const float* szero, const int8_t* xq, const float* sa,
                const float* gsum, const int32_t* gidx, const uint8_t* lut, T* out, int64_t k, int64_t n_out,
                int64_t group, int64_t t0, int64_t t1) {
  const int64_t nb = k / QB, ng = k / group, block_bytes = 16 * QB * BITS / 8;
  const __m512i mask = _mm512_set1_epi8(0x0F);
  // the 16-entry table in each 128-bit lane, as vpshufb indexes it per lane
  const __m512i table = LUT ? _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(lut)))
                            : _mm512_setzero_si512();
  for (int64_t t = t0; t < t1; ++t) {
    const uint8_t* wt = w + t * nb * block_bytes;
    const float* ts = scale + t * ng * 16;
    const float* tz = szero + t * ng * 16;
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
      const __m512 sv = _mm512_loadu_ps(ts + gidx[b] * 16);
#pragma GCC unroll 8
      for (int r = 0; r < M; ++r) {
        const __m512 d = _mm512_cvtepi32_ps(_mm512_add_epi32(lo_acc[r], hi_acc[r]));
        acc[r] = _mm512_fmadd_ps(d, _mm512_mul_ps(sv, _mm512_set1_ps(sa[r * nb + b])), acc[r]);
      }
    }
    for (int64_t g = 0; g < ng; ++g) {
      const __m512 zv = _mm512_loadu_ps(tz + g * 16);
#pragma GCC unroll 8
      for (int r = 0; r < M; ++r) acc[r] = _mm512_fnmadd_ps(zv, _mm512_set1_ps(gsum[r * ng + g]), acc[r]);
    }
    const int64_t rows = std::min<int64_t>(16, n_out - t * 16);
    alignas(64) float y[16];
    for (int r = 0; r < M; ++r) {
      _mm512_store_ps(y, acc[r]);
      for (int64_t i = 0; i < rows; ++i) st(out, r * n_out + t * 16 + i, y[i]);
    }
  }
}
#endif

bool has_vnni() {
#ifdef COMPRESS_VNNI
  return true;
#else
  return false;
#endif
}

// y [M, N] = x [M, K] @ dequant(w)^T, y in x's dtype. w: the codes of N rows padded to tiles of 16, as uint8
// [tiles, K * 16 * bits / 8] in qmatmul.py's pack_tiles layout; scale and szero = scale * zero: fp32
// [tiles, G, 16] (G = K / group). K a multiple of 32, the group a multiple of 32 dividing K. lut: uint8 [16],
// 4-bit codes only: each code q stands for lut[q] (zero and scale in lut units).
at::Tensor w8a8_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale, const at::Tensor& szero,
                       int64_t bits, int64_t group, int64_t n_out, const std::optional<at::Tensor>& lut) {
  TORCH_CHECK(has_vnni(), "w8a8_linear needs AVX512-VNNI, which this build of the kernels lacks");
  check_cpu(x, "x");
  check_cpu(w, "w");
  check_cpu(scale, "scale");
  check_cpu(szero, "szero");
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8");
  const bool has_lut = lut.has_value() && lut->defined();
  TORCH_CHECK(!has_lut || (bits == 4 && lut->scalar_type() == at::kByte && lut->numel() == 16 && lut->is_contiguous()),
              "lut: a contiguous uint8 [16] table, for 4-bit codes");
  const uint8_t* lut_p = has_lut ? lut->data_ptr<uint8_t>() : nullptr;
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && w.scalar_type() == at::kByte, "x [M, K] and uint8 w [tiles, bytes]");
  const int64_t m = x.size(0), k = x.size(1), tiles = w.size(0);
  TORCH_CHECK(k % QB == 0 && group % QB == 0 && k % group == 0, "K (", k, ") and the group (", group,
              ") must be multiples of 32, the group dividing K");
  TORCH_CHECK(w.size(1) * 8 == k * 16 * bits, "w has ", w.size(1), " bytes per tile; K = ", k, " needs ",
              k * 2 * bits);
  TORCH_CHECK(n_out > (tiles - 1) * 16 && n_out <= tiles * 16, "n_out ", n_out, " does not fit ", tiles, " tiles");
  const int64_t ng = k / group;
  for (const at::Tensor* t : {&scale, &szero})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->numel() == tiles * ng * 16, "scale/szero: fp32 [", tiles, ", ",
                ng, ", 16]");
  auto out = at::empty({m, n_out}, x.options());
#ifdef COMPRESS_VNNI
  const int64_t nb = k / QB;
  std::vector<int8_t> xq(m * k);
  std::vector<float> sa(m * nb), gsum(m * ng);
  std::vector<int32_t> gidx(nb);  // weight group of each 32-block
  for (int64_t b = 0; b < nb; ++b) gidx[b] = static_cast<int32_t>(b * QB / group);
  DISPATCH_F32_BF16(x.scalar_type(), "w8a8_linear", [&] {
    quantize_rows<scalar_t>(x.data_ptr<scalar_t>(), m, k, group, xq.data(), sa.data(), gsum.data());
    for (int64_t r0 = 0; r0 < m; r0 += MAXM) {
      const int64_t mr = std::min(MAXM, m - r0);
      const int8_t* xp = xq.data() + r0 * k;
      const float* sp = sa.data() + r0 * nb;
      const float* gp = gsum.data() + r0 * ng;
      scalar_t* op = out.data_ptr<scalar_t>() + r0 * n_out;
      at::parallel_for(0, tiles, 4, [&](int64_t begin, int64_t end) {
        auto run = [&](auto bits_c, auto lut_c, auto m_c) {
          gemv_tiles<decltype(bits_c)::value, decltype(m_c)::value, decltype(lut_c)::value, scalar_t>(
              w.data_ptr<uint8_t>(), scale.data_ptr<float>(), szero.data_ptr<float>(), xp, sp, gp, gidx.data(), lut_p,
              op, k, n_out, group, begin, end);
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
        if (bits == 8)
          with_m(std::integral_constant<int, 8>{}, std::false_type{});
        else if (has_lut)
          with_m(std::integral_constant<int, 4>{}, std::true_type{});
        else
          with_m(std::integral_constant<int, 4>{}, std::false_type{});
      });
    }
  });
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(compress_cpu, m) {
  m.def("has_vnni() -> bool", &has_vnni);
  m.def("w8a8_linear(Tensor x, Tensor w, Tensor scale, Tensor szero, int bits, int group, int n_out, "
        "Tensor? lut=None) -> Tensor", &w8a8_linear);
}
