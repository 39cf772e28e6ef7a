// Helpers the CPU kernels in this folder share: bf16 element access, dispatch, exp, input checks.
#pragma once
#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace compress_cpu {

// fp32 and bf16 only (the runtime's compute dtypes on CPU; select_ops sends anything else to torch)
#define DISPATCH_F32_BF16(TYPE, NAME, ...) \
  AT_DISPATCH_SWITCH(TYPE, NAME, AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__) AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__))

// Element access through plain integers: GCC vectorizes loads and stores of uint16_t, not of c10::BFloat16
// (a class). bf16 -> fp32 is a shift; fp32 -> bf16 rounds to nearest even, as c10's conversion does.
inline float ld(const float* p, int64_t i) { return p[i]; }
inline float ld(const c10::BFloat16* p, int64_t i) {
  const uint32_t bits = static_cast<uint32_t>(reinterpret_cast<const uint16_t*>(p)[i]) << 16;
  float f;
  __builtin_memcpy(&f, &bits, sizeof(f));
  return f;
}
inline uint16_t bf16_bits(float v) {
  uint32_t b;
  __builtin_memcpy(&b, &v, sizeof(b));
  return static_cast<uint16_t>((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
}
inline void st(float* p, int64_t i, float v) { p[i] = v; }
inline void st(c10::BFloat16* p, int64_t i, float v) { reinterpret_cast<uint16_t*>(p)[i] = bf16_bits(v); }

// the value eager torch would hold after storing an fp32 result in T
template <typename T>
inline float rounded(float v);
template <>
inline float rounded<float>(float v) { return v; }
template <>
inline float rounded<c10::BFloat16>(float v) {
  const uint32_t bits = static_cast<uint32_t>(bf16_bits(v)) << 16;
  float f;
  __builtin_memcpy(&f, &bits, sizeof(f));
  return f;
}

// exp(x) for fp32 (Cephes' expf: Cody-Waite reduction, degree-5 polynomial, about 1 ulp on [-87, 88]) written
// so that loops over it vectorize: libm's expf is a scalar call, and its vector form needs -ffast-math
inline float vexp(float x) {
  x = std::min(std::max(x, -87.33654f), 88.72283f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  float r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * r * r + r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  __builtin_memcpy(&scale, &bits, sizeof(scale));
  return y * scale;
}

inline void check_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

// a W8A8 tile weight's scale and szero (runtime/kernels/w8a8.py's half_scales): contiguous CPU fp16 [tiles, groups,
// 16] each; their bits, as the kernels read them
inline const uint16_t* half_scales(const at::Tensor& t, int64_t tiles, int64_t groups, const char* name) {
  check_cpu(t, name);
  TORCH_CHECK(t.scalar_type() == at::kHalf && t.numel() == tiles * groups * 16, name, ": fp16 [", tiles, ", ",
              groups, ", 16]");
  return reinterpret_cast<const uint16_t*>(t.data_ptr<at::Half>());
}

#ifdef __AVX512F__
// 16 fp16 values (their bits) -> fp32 (vcvtph2ps)
inline __m512 half16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
#endif

}  // namespace compress_cpu
