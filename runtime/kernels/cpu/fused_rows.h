// One row of each small fused op (fused_ops.cpp has the story and the numerics): fused_ops.cpp's ops run them over
// a tensor's rows in parallel, decode_step.cpp inside its one parallel region.
#pragma once
#include "common.h"

#include <cmath>

namespace compress_cpu {

// out = x / rms(x) * (offset + w) over one row of dim; when delta is given, x += delta first, in place
template <typename T>
inline void rms_row(T* x, const T* delta, const T* w, T* out, int64_t dim, float eps, float offset) {
  if (delta != nullptr)
    for (int64_t i = 0; i < dim; ++i) st(x, i, ld(x, i) + ld(delta, i));
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < dim; ++i) ss += ld(x, i) * ld(x, i);
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(dim) + eps);
  for (int64_t i = 0; i < dim; ++i) st(out, i, ld(x, i) * inv * (offset + ld(w, i)));
}

// dst [inter] = act(gate) * up for one row gate_up = [gate (inter), up (inter)]; a: fp32 scratch [inter].
// act: 0 silu, 1 gelu (tanh), 2 gelu (erf)
template <typename T>
inline void act_row(const T* g, T* dst, int64_t inter, int64_t act, float* a) {
  const T* u = g + inter;
  if (act == 0) {
#pragma omp simd
    for (int64_t c = 0; c < inter; ++c) {
      const float x = ld(g, c);
      a[c] = x / (1.f + vexp(-x));
    }
  } else if (act == 1) {
#pragma omp simd
    for (int64_t c = 0; c < inter; ++c) {
      const float x = ld(g, c);
      const float y = 0.7978845608028654f * (x + 0.044715f * x * x * x);
      a[c] = 0.5f * x * (2.f - 2.f / (vexp(2.f * y) + 1.f));  // 1 + tanh(y)
    }
  } else {
#pragma omp simd
    for (int64_t c = 0; c < inter; ++c) {
      const float x = ld(g, c);
      a[c] = 0.5f * x * (1.f + std::erf(x * 0.7071067811865476f));
    }
  }
#pragma omp simd
  for (int64_t c = 0; c < inter; ++c) st(dst, c, rounded<T>(a[c]) * ld(u, c));
}

// one head row [D] rotated in place (rotate_half layout): x * cos + roll(x, D/2) * sin with cos = [c, c] and
// sin = [-s, s] given as c (cos) and s (sin) rows [D] of the rotary table, in T
template <typename T>
inline void rope_row(T* row, const T* c, const T* s, int64_t d) {
  const int64_t half = d / 2;
  for (int64_t j = 0; j < half; ++j) {
    const float x1 = ld(row, j), x2 = ld(row, j + half);
    const float lo = rounded<T>(x1 * ld(c, j)) + rounded<T>(x2 * ld(s, j));
    const float hi = rounded<T>(x2 * ld(c, j + half)) + rounded<T>(x1 * ld(s, j + half));
    st(row, j, lo);
    st(row, j + half, hi);
  }
}

}  // namespace compress_cpu
