// H += alpha * x^T x for bf16 rows x [tokens, n], summed in fp32: the Hessian of GPTQ's calibration (its
// products are 37% of a guided-gptq4 block on a 0.5B shape, the 4,864-wide down_proj's 83% of them).
//
// torch's bf16 matmul on CPU returns bf16: rounding each product matrix to 8 bits of mantissa breaks its
// positive definiteness (SmolLM2's block 0 o_proj then fails its Cholesky), so GPTQ kept fp32 products at
// half the bf16 rate. Here the inputs are bf16 and every product and sum fp32 (vdpbf16ps multiplies two bf16
// pairs exactly and adds them into fp32 lanes): the result is the Gram of the bf16 inputs, positive semidefinite
// as any Gram, matching an fp32 product of the same values to fp32 summation order.
//
// Blocked as a GEMM over token pairs: a block of KC token pairs is packed once into row strips of MR inputs and
// column strips of NR (each value a dword holding the pair's two bf16, so one broadcast and one vector meet in
// a vdpbf16ps), then each MR x NR tile of the lower triangle sums the block in 2 * MR vector registers and adds
// alpha times it to H; the threads share the tiles. The upper triangle is copied from the lower at the end, so
// H stays exactly symmetric.
#include "common.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define COMPRESS_BF16_DOT 1
#include <immintrin.h>
#endif

namespace {

using namespace compress_cpu;

bool has_bf16_dot() {
#ifdef COMPRESS_BF16_DOT
  return true;
#else
  return false;
#endif
}

#ifdef COMPRESS_BF16_DOT
constexpr int64_t MR = 12;   // rows of a tile: one broadcast each
constexpr int64_t NR = 32;   // columns: two vectors of 16 fp32 lanes
constexpr int64_t KC = 256;  // token pairs a block packs (512 tokens)

// the pair (x[2p, i], x[2p + 1, i]) of each strip's inputs, strip by strip: [strips][kc][width] dwords
void pack(const uint16_t* x, int64_t tokens, int64_t n, int64_t p0, int64_t kc, int64_t width, uint32_t* out) {
  at::parallel_for(0, (n + width - 1) / width, 1, [&](int64_t s0, int64_t s1) {
    for (int64_t s = s0; s < s1; ++s)
      for (int64_t p = 0; p < kc; ++p) {
        const int64_t t = 2 * (p0 + p);
        const uint16_t* r0 = x + t * n;
        const uint16_t* r1 = t + 1 < tokens ? r0 + n : nullptr;  // an odd count's last token pairs with zero
        uint32_t* o = out + (s * kc + p) * width;
        for (int64_t j = 0; j < width; ++j) {
          const int64_t c = s * width + j;
          o[j] = c < n ? static_cast<uint32_t>(r0[c]) | (r1 ? static_cast<uint32_t>(r1[c]) << 16 : 0u) : 0u;
        }
      }
  });
}

// alpha * (the tile's sum over the block) added to H's rows i0.. and columns j0.., inside n
void tile(const uint32_t* a, const uint32_t* b, int64_t kc, float alpha, float* h, int64_t n, int64_t i0,
          int64_t j0) {
  __m512 acc[MR][2];
  for (int64_t r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t p = 0; p < kc; ++p) {
    const __m512bh b0 = (__m512bh)_mm512_loadu_si512(b + p * NR);
    const __m512bh b1 = (__m512bh)_mm512_loadu_si512(b + p * NR + 16);
    const uint32_t* ap = a + p * MR;
    for (int64_t r = 0; r < MR; ++r) {
      const __m512bh av = (__m512bh)_mm512_set1_epi32(static_cast<int>(ap[r]));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], av, b0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], av, b1);
    }
  }
  const __m512 va = _mm512_set1_ps(alpha);
  const int64_t cols = std::min(NR, n - j0);
  const __mmask16 m0 = cols >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << cols) - 1u);
  const __mmask16 m1 = cols >= 32 ? 0xFFFF : cols <= 16 ? 0 : static_cast<__mmask16>((1u << (cols - 16)) - 1u);
  for (int64_t r = 0; r < MR && i0 + r < n; ++r) {
    float* row = h + (i0 + r) * n + j0;
    _mm512_mask_storeu_ps(row, m0, _mm512_fmadd_ps(acc[r][0], va, _mm512_maskz_loadu_ps(m0, row)));
    if (m1) _mm512_mask_storeu_ps(row + 16, m1, _mm512_fmadd_ps(acc[r][1], va, _mm512_maskz_loadu_ps(m1, row + 16)));
  }
}
#endif

// H [n, n] fp32 (symmetric) += alpha * x^T x, x [tokens, n] bf16
void gram_bf16_(at::Tensor& h, const at::Tensor& x, double alpha) {
  check_cpu(h, "h");
  check_cpu(x, "x");
  TORCH_CHECK(h.scalar_type() == at::kFloat && x.scalar_type() == at::kBFloat16, "gram_bf16_: fp32 h, bf16 x");
  TORCH_CHECK(x.dim() == 2 && h.dim() == 2 && h.size(0) == x.size(1) && h.size(1) == x.size(1),
              "gram_bf16_: x [tokens, n], h [n, n]");
#ifdef COMPRESS_BF16_DOT
  const int64_t tokens = x.size(0), n = x.size(1), pairs = (tokens + 1) / 2;
  const int64_t rows = (n + MR - 1) / MR, cols = (n + NR - 1) / NR;
  std::vector<int64_t> tiles;  // (row strip, column strip) of every tile that holds a lower-triangle entry
  for (int64_t c = 0; c < cols; ++c)
    for (int64_t r = (c * NR) / MR; r < rows; ++r) tiles.push_back(r * cols + c);
  std::vector<uint32_t> a(rows * MR * KC), b(cols * NR * KC);
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  float* hp = h.data_ptr<float>();
  for (int64_t p0 = 0; p0 < pairs; p0 += KC) {
    const int64_t kc = std::min(KC, pairs - p0);
    pack(xp, tokens, n, p0, kc, MR, a.data());
    pack(xp, tokens, n, p0, kc, NR, b.data());
    at::parallel_for(0, static_cast<int64_t>(tiles.size()), 1, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t r = tiles[t] / cols, c = tiles[t] % cols;
        tile(a.data() + r * kc * MR, b.data() + c * kc * NR, kc, static_cast<float>(alpha), hp, n, r * MR, c * NR);
      }
    });
  }
  constexpr int64_t B = 64;  // the mirror in 64 x 64 blocks, each read and written within cache
  at::parallel_for(0, (n + B - 1) / B, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t bi = b0; bi < b1; ++bi)
      for (int64_t j0 = bi * B; j0 < n; j0 += B)
        for (int64_t i = bi * B; i < std::min(n, bi * B + B); ++i)
          for (int64_t j = std::max(j0, i + 1); j < std::min(n, j0 + B); ++j) hp[i * n + j] = hp[j * n + i];
  });
#else
  TORCH_CHECK(false, "gram_bf16_: this build has no AVX512-BF16 (has_bf16_dot() is false): use the fp32 path");
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(compress_cpu, m) {
  m.def("has_bf16_dot() -> bool", &has_bf16_dot);
  m.def("gram_bf16_(Tensor(a!) h, Tensor x, float alpha) -> ()", &gram_bf16_);
}
