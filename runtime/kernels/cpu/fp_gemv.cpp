// fp32 weights times a few fp32 rows (the decode step of an fp32 model), streaming each weight row once.
//
// At batch 1 an fp32 linear is a matter of reading its bytes: MKL's sgemm behind F.linear reads ~11 GB/s on
// the AMD EPYC's 2 cores where a plain sum streams 32 GB/s. Here each thread takes a contiguous range of
// output rows and dots each with every input row (the row stays in L1 while it does), 4 independent
// accumulators per dot. The summation order differs from MKL's, so results match F.linear to fp32 rounding,
// not bit for bit.
#include "common.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

using namespace compress_cpu;

inline float dot_f32(const float* a, const float* b, int64_t k) {
  int64_t j = 0;
  float s = 0.f;
#if defined(__AVX512F__)
  __m512 c0 = _mm512_setzero_ps(), c1 = _mm512_setzero_ps(), c2 = _mm512_setzero_ps(), c3 = _mm512_setzero_ps();
  for (; j + 64 <= k; j += 64) {
    c0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + j), _mm512_loadu_ps(b + j), c0);
    c1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + j + 16), _mm512_loadu_ps(b + j + 16), c1);
    c2 = _mm512_fmadd_ps(_mm512_loadu_ps(a + j + 32), _mm512_loadu_ps(b + j + 32), c2);
    c3 = _mm512_fmadd_ps(_mm512_loadu_ps(a + j + 48), _mm512_loadu_ps(b + j + 48), c3);
  }
  for (; j + 16 <= k; j += 16) c0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + j), _mm512_loadu_ps(b + j), c0);
  if (j < k) {
    const __mmask16 mask = static_cast<__mmask16>((1u << (k - j)) - 1u);
    c1 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mask, a + j), _mm512_maskz_loadu_ps(mask, b + j), c1);
    j = k;
  }
  s = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(c0, c1), _mm512_add_ps(c2, c3)));
#endif
  for (; j < k; ++j) s += a[j] * b[j];
  return s;
}

// y [M, N] = x [M, K] @ w [N, K]^T (+ bias), fp32
at::Tensor fp32_gemv(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  check_cpu(x, "x");
  check_cpu(w, "w");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, "fp32_gemv: fp32 x and w");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "fp32_gemv: x [M, K], w [N, K]");
  const int64_t m = x.size(0), k = x.size(1), n = w.size(0);
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    check_cpu(*bias, "bias");
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == n, "fp32_gemv: bias fp32 [N]");
    bp = bias->data_ptr<float>();
  }
  auto out = at::empty({m, n}, x.options());
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* yp = out.data_ptr<float>();
  at::parallel_for(0, n, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t i = 0; i < m; ++i) yp[i * n + r] = dot_f32(xp + i * k, wp + r * k, k) + (bp ? bp[r] : 0.f);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(compress_cpu, m) {
  m.def("fp32_gemv(Tensor x, Tensor w, Tensor? bias) -> Tensor", &fp32_gemv);
}
