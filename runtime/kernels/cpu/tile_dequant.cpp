// The weights of a W8A8Linear (qgemv.cpp's tile layout) dequantized into a caller's bf16 or fp32 buffer, for the
// calls with many rows (prefill, batched decoding) that a dense GEMM runs faster than the integer kernel.
//
// runtime/kernels/qmatmul.py dequantizes each linear into one scratch buffer shared by all of them just before its
// GEMM, so no persistent dense copy of the model is kept. One pass over the codes: 16 output rows per tile, each
// weight w = code * scale - scale * zero (szero), rounded to the output dtype; scale and szero are fp16 times
// 1 / unscale (w8a8.py's half_scales), each made fp32 and multiplied by unscale (exact: a power of two) first. The
// torch reference is runtime/kernels/w8a8.py's dequant_tiles.
#include "common.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <optional>
#include <type_traits>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define COMPRESS_AVX512 1
#include <immintrin.h>
#endif

namespace {

using namespace compress_cpu;

// one tile's 16 rows (those below n_out) into out rows [16 t, 16 t + 16): tile bytes [K/8 chunks of 8 columns]
// x [64 bytes: 4-bit, row r's byte 4r+i = q[8p+i] | q[8p+4+i] << 4] or [2 x 64 bytes: 8-bit, q[8p+4h+i]]
template <int BITS, typename T>
void dequant_tile(const uint8_t* tile, const uint16_t* scale, const uint16_t* szero, float unscale,
                  const uint8_t* lut, T* out, int64_t k, int64_t group, int64_t rows) {
  const int64_t ng = k / group;
  auto half = [](uint16_t bits) { return static_cast<float>(c10::Half(bits, c10::Half::from_bits())); };
  for (int64_t r = 0; r < rows; ++r) {
    T* o = out + r * k;
    for (int64_t g = 0; g < ng; ++g) {
      const float s = half(scale[g * 16 + r]) * unscale, sz = half(szero[g * 16 + r]) * unscale;
      for (int64_t p = g * group / 8; p < (g + 1) * group / 8; ++p) {
        float v[8];
        if constexpr (BITS == 4) {
          const uint8_t* b = tile + p * 64 + r * 4;
          for (int i = 0; i < 4; ++i) {
            const uint8_t lo = b[i] & 15, hi = b[i] >> 4;
            v[i] = static_cast<float>(lut ? lut[lo] : lo);
            v[4 + i] = static_cast<float>(lut ? lut[hi] : hi);
          }
        } else {
          const uint8_t* b = tile + p * 128 + r * 4;
          for (int i = 0; i < 4; ++i) {
            v[i] = static_cast<float>(b[i]);
            v[4 + i] = static_cast<float>(b[64 + i]);
          }
        }
        for (int i = 0; i < 8; ++i) st(o, p * 8 + i, v[i] * s - sz);
      }
    }
  }
}

#ifdef COMPRESS_AVX512
// fp32 [16] -> bf16 [16], rounded to nearest even (as bf16_bits)
inline __m256i to_bf16(__m512 v) {
  const __m512i b = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(_mm512_add_epi32(b, _mm512_set1_epi32(0x7FFF)), odd);
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
}

// a full tile (16 rows) into bf16: per chunk of 8 columns, one 64-byte load holds all 16 rows (row r in dword r);
// unpacking the low and high codes by dword puts each row's 8 codes together, two rows per 128-bit lane
template <int BITS>
void dequant_tile_bf16(const uint8_t* tile, const uint16_t* scale, const uint16_t* szero, float unscale,
                       const uint8_t* lut, uint16_t* out, int64_t k, int64_t group) {
  const __m512i nib = _mm512_set1_epi8(0x0F);
  const __m512i table = lut ? _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(lut)))
                            : _mm512_setzero_si512();
  __m512i idx[8];  // vector j = 2 rows x 8 columns: rows (j / 2) * 4 + (j % 2) * 2 + {0, 1} (see below)
  for (int j = 0; j < 8; ++j) {
    const int r0 = (j / 2) * 4 + (j % 2) * 2;
    idx[j] = _mm512_setr_epi32(r0, r0, r0, r0, r0, r0, r0, r0, r0 + 1, r0 + 1, r0 + 1, r0 + 1, r0 + 1, r0 + 1,
                               r0 + 1, r0 + 1);
  }
  for (int64_t g = 0; g < k / group; ++g) {
    const __m512 u = _mm512_set1_ps(unscale);
    const __m512 s16 = _mm512_mul_ps(half16(scale + g * 16), u), z16 = _mm512_mul_ps(half16(szero + g * 16), u);
    __m512 s[8], z[8];
    for (int j = 0; j < 8; ++j) {
      s[j] = _mm512_permutexvar_ps(idx[j], s16);
      z[j] = _mm512_permutexvar_ps(idx[j], z16);
    }
    for (int64_t p = g * group / 8; p < (g + 1) * group / 8; ++p) {
      __m512i lo, hi;
      if constexpr (BITS == 4) {
        const __m512i b = _mm512_loadu_si512(tile + p * 64);
        lo = _mm512_and_si512(b, nib);
        hi = _mm512_and_si512(_mm512_srli_epi16(b, 4), nib);
        if (lut) {
          lo = _mm512_shuffle_epi8(table, lo);
          hi = _mm512_shuffle_epi8(table, hi);
        }
      } else {
        lo = _mm512_loadu_si512(tile + p * 128);
        hi = _mm512_loadu_si512(tile + p * 128 + 64);
      }
      // lane L of a: rows 4L, 4L+1 (8 codes each, in column order); of c: rows 4L+2, 4L+3
      const __m512i a = _mm512_unpacklo_epi32(lo, hi), c = _mm512_unpackhi_epi32(lo, hi);
      const __m128i qa[4] = {_mm512_extracti32x4_epi32(a, 0), _mm512_extracti32x4_epi32(a, 1),
                             _mm512_extracti32x4_epi32(a, 2), _mm512_extracti32x4_epi32(a, 3)};
      const __m128i qc[4] = {_mm512_extracti32x4_epi32(c, 0), _mm512_extracti32x4_epi32(c, 1),
                             _mm512_extracti32x4_epi32(c, 2), _mm512_extracti32x4_epi32(c, 3)};
      for (int lane = 0; lane < 4; ++lane) {
        for (int h = 0; h < 2; ++h) {
          const int j = lane * 2 + h, r0 = lane * 4 + h * 2;
          const __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(h == 0 ? qa[lane] : qc[lane]));
          const __m256i v = to_bf16(_mm512_sub_ps(_mm512_mul_ps(q, s[j]), z[j]));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(out + r0 * k + p * 8), _mm256_castsi256_si128(v));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(out + (r0 + 1) * k + p * 8), _mm256_extracti128_si256(v, 1));
        }
      }
    }
  }
}
#endif

// out [n_out, K] (bf16 or fp32, contiguous, rows past n_out of the last tile dropped) <- the tiles' weights
void w8a8_dequant_(at::Tensor out, const at::Tensor& w, const at::Tensor& scale, const at::Tensor& szero,
                   double unscale, int64_t bits, int64_t group, const std::optional<at::Tensor>& lut) {
  check_cpu(out, "out");
  check_cpu(w, "w");
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8");
  TORCH_CHECK(out.dim() == 2 && w.dim() == 2 && w.scalar_type() == at::kByte, "out [N, K] and uint8 w [tiles, bytes]");
  const int64_t n_out = out.size(0), k = out.size(1), tiles = w.size(0);
  TORCH_CHECK(k % 32 == 0 && group % 32 == 0 && k % group == 0, "K (", k, ") and the group (", group,
              ") must be multiples of 32, the group dividing K");
  TORCH_CHECK(w.size(1) * 8 == k * 16 * bits, "w has ", w.size(1), " bytes per tile; K = ", k, " needs ", k * 2 * bits);
  TORCH_CHECK(n_out > (tiles - 1) * 16 && n_out <= tiles * 16, "N ", n_out, " does not fit ", tiles, " tiles");
  const int64_t ng = k / group;
  const uint16_t* scale_p = half_scales(scale, tiles, ng, "scale");
  const uint16_t* szero_p = half_scales(szero, tiles, ng, "szero");
  const float u = static_cast<float>(unscale);
  const bool has_lut = lut.has_value() && lut->defined();
  TORCH_CHECK(!has_lut || (bits == 4 && lut->scalar_type() == at::kByte && lut->numel() == 16 && lut->is_contiguous()),
              "lut: a contiguous uint8 [16] table, for 4-bit codes");
  const uint8_t* lut_p = has_lut ? lut->data_ptr<uint8_t>() : nullptr;
  const int64_t tile_bytes = w.size(1);
  DISPATCH_F32_BF16(out.scalar_type(), "w8a8_dequant_", [&] {
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, tiles, 16, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const uint8_t* tile = w.data_ptr<uint8_t>() + t * tile_bytes;
        const uint16_t* sp = scale_p + t * ng * 16;
        const uint16_t* zp = szero_p + t * ng * 16;
        const int64_t rows = std::min<int64_t>(16, n_out - t * 16);
#ifdef COMPRESS_AVX512
        if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
          if (rows == 16) {
            auto* o = reinterpret_cast<uint16_t*>(op + t * 16 * k);
            if (bits == 4)
              dequant_tile_bf16<4>(tile, sp, zp, u, lut_p, o, k, group);
            else
              dequant_tile_bf16<8>(tile, sp, zp, u, lut_p, o, k, group);
            continue;
          }
        }
#endif
        if (bits == 4)
          dequant_tile<4>(tile, sp, zp, u, lut_p, op + t * 16 * k, k, group, rows);
        else
          dequant_tile<8>(tile, sp, zp, u, lut_p, op + t * 16 * k, k, group, rows);
      }
    });
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(compress_cpu, m) {
  m.def("w8a8_dequant_(Tensor(a!) out, Tensor w, Tensor scale, Tensor szero, float unscale, int bits, int group, "
        "Tensor? lut=None) -> ()", &w8a8_dequant_);
}
