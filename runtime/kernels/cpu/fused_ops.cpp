// Fused CPU kernels for the runtime's per-token path (runtime/kernels/cpu_ext.py builds and loads this).
//
// At batch 1 a decode step is ~30 layers x a dozen small ops; in eager torch each op costs microseconds of
// dispatch and several composite kernels (F.rms_norm alone is five), which is most of a step on a small
// model. Each op here is one call over the whole tensor. Numerics follow the torch reference path op for op:
// fp32 arithmetic inside, and in bf16 the same roundings eager torch makes (the residual add, silu(gate)
// before the product, the two products and the sum of rotary), so the two paths agree to accumulation order.
// Compiled with -ffp-contract=off: no fused multiply-adds that the reference does not make.
#include "fused_rows.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

using namespace compress_cpu;

// rows of rms_row (fused_rows.h)
template <typename T>
void rms_rows(T* x, const T* delta, const T* w, T* out, int64_t rows, int64_t dim, float eps, float offset) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      rms_row(x + r * dim, delta == nullptr ? nullptr : delta + r * dim, w, out + r * dim, dim, eps, offset);
  });
}

at::Tensor rms_norm_impl(at::Tensor x, const at::Tensor& delta, const at::Tensor& w, double eps, double offset,
                         bool with_delta) {
  check_cpu(x, "x");
  check_cpu(w, "weight");
  TORCH_CHECK(w.scalar_type() == x.scalar_type(), "weight dtype must match x");
  const int64_t dim = x.size(-1);
  TORCH_CHECK(w.numel() == dim, "weight has ", w.numel(), " elements, rows have ", dim);
  if (with_delta) {
    check_cpu(delta, "delta");
    TORCH_CHECK(delta.sizes() == x.sizes() && delta.scalar_type() == x.scalar_type(), "delta must match x");
  }
  auto out = at::empty_like(x);
  DISPATCH_F32_BF16(x.scalar_type(), "rms_norm", [&] {
    rms_rows<scalar_t>(x.data_ptr<scalar_t>(), with_delta ? delta.data_ptr<scalar_t>() : nullptr,
                       w.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), x.numel() / dim, dim,
                       static_cast<float>(eps), static_cast<float>(offset));
  });
  return out;
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps, double offset) {
  return rms_norm_impl(x, x, w, eps, offset, false);
}

// residual += delta (in place), then returns rms_norm(residual)
at::Tensor add_rms_norm_(at::Tensor residual, const at::Tensor& delta, const at::Tensor& w, double eps,
                         double offset) {
  return rms_norm_impl(residual, delta, w, eps, offset, true);
}

template <typename T>
void act_rows(const T* src, T* dst, int64_t rows, int64_t inter, int64_t act) {
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> a(inter);
    for (int64_t r = begin; r < end; ++r) act_row(src + r * 2 * inter, dst + r * inter, inter, act, a.data());
  });
}

// gate_up [..., 2I] (gate half first) -> act(gate) * up [..., I]; rows in parallel, each row's activation in
// SIMD lanes (vexp; the exact gelu's erf stays a scalar libm call)
at::Tensor act_mul(const at::Tensor& gate_up, int64_t act) {
  check_cpu(gate_up, "gate_up");
  TORCH_CHECK(act >= 0 && act <= 2, "act must be 0 (silu), 1 (gelu tanh) or 2 (gelu)");
  const int64_t width = gate_up.size(-1);
  TORCH_CHECK(width % 2 == 0, "gate_up's last dimension must be even");
  const int64_t inter = width / 2;
  auto sizes = gate_up.sizes().vec();
  sizes.back() = inter;
  auto out = at::empty(sizes, gate_up.options());
  DISPATCH_F32_BF16(gate_up.scalar_type(), "act_mul", [&] {
    act_rows<scalar_t>(gate_up.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), gate_up.numel() / width, inter, act);
  });
  return out;
}

template <typename T>
void int8_rows(const float* xp, const int8_t* wp, const float* sp, T* op, int64_t m, int64_t k, int64_t n,
               int64_t kw) {
  at::parallel_for(0, n, 256, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      const int8_t* row = wp + j * kw;
      for (int64_t i = 0; i < m; ++i) {
        const float* xi = xp + i * k;
        float acc = 0.f;
#pragma omp simd reduction(+ : acc)
        for (int64_t c = 0; c < k; ++c) acc += xi[c] * static_cast<float>(row[c]);
        st(op, i * n + j, acc * sp[j]);
      }
    }
  });
}

// y [M, N] = x [M, K] @ (w [N, Kw >= K] int8 * scale [N])^T, accumulated in fp32, y in x's dtype. Weight-only
// int8 for a few rows (decode, the LM head): each weight row is read once for all M rows of x.
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale) {
  check_cpu(x, "x");
  check_cpu(w, "w");
  check_cpu(scale, "scale");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && w.scalar_type() == at::kChar, "x [M, K] and int8 w [N, K]");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.numel() == w.size(0), "scale: fp32, one per row of w");
  const int64_t m = x.size(0), k = x.size(1), n = w.size(0), kw = w.size(1);
  TORCH_CHECK(kw >= k, "w has ", kw, " columns, x ", k);
  auto xf = x.to(at::kFloat).contiguous();
  auto out = at::empty({m, n}, x.options());
  DISPATCH_F32_BF16(x.scalar_type(), "int8_linear", [&] {
    int8_rows<scalar_t>(xf.data_ptr<float>(), w.data_ptr<int8_t>(), scale.data_ptr<float>(),
                        out.data_ptr<scalar_t>(), m, k, n, kw);
  });
  return out;
}

// In place on the first `heads` heads of x [T, H, D] (rotate_half layout): x * cos + roll(x, D/2) * sin,
// with cos = [c, c] and sin = [-s, s] as [T, 1, D] (runtime/models/layers.py's Rotary)
void rope_(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin, int64_t heads) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 3 && x.stride(2) == 1, "x must be a CPU [T, H, D] tensor, "
              "contiguous in D");
  check_cpu(cos, "cos");
  check_cpu(sin, "sin");
  const int64_t t = x.size(0), d = x.size(2);
  TORCH_CHECK(heads <= x.size(1) && d % 2 == 0, "bad heads or odd head_dim");
  TORCH_CHECK(cos.numel() == t * d && sin.numel() == t * d, "cos/sin must be [T, 1, D]");
  TORCH_CHECK(cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(),
              "cos/sin dtype must match x");
  const int64_t row_stride = x.stride(0), head_stride = x.stride(1);
  DISPATCH_F32_BF16(x.scalar_type(), "rope_", [&] {
    scalar_t* base = x.data_ptr<scalar_t>();
    const scalar_t* cp = cos.data_ptr<scalar_t>();
    const scalar_t* sp = sin.data_ptr<scalar_t>();
    at::parallel_for(0, t * heads, 64, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t tok = i / heads, h = i % heads;
        rope_row(base + tok * row_stride + h * head_stride, cp + tok * d, sp + tok * d, d);
      }
    });
  });
}

// k_cache/v_cache [blocks, block, Hkv, D] rows at `slots` [T] (int64) <- k, v [T, Hkv, D] (each token's Hkv x D
// contiguous, as slices of the fused qkv projection are): one call for both stores
void write_kv_(at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& k, const at::Tensor& v,
               const at::Tensor& slots) {
  check_cpu(k_cache, "k_cache");
  check_cpu(v_cache, "v_cache");
  check_cpu(slots, "slots");
  const int64_t t = k.size(0), hkv = k_cache.size(2), d = k_cache.size(3);
  for (const at::Tensor* x : {&k, &v})
    TORCH_CHECK(x->device().is_cpu() && x->dim() == 3 && x->size(1) == hkv && x->size(2) == d && x->stride(2) == 1 &&
                x->stride(1) == d && x->size(0) == t && x->scalar_type() == k_cache.scalar_type(),
                "k and v must be [T, Hkv, D] with each token's heads contiguous, in the cache's dtype");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.numel() == t, "slots: int64, one per token");
  const int64_t row = hkv * d, capacity = k_cache.size(0) * k_cache.size(1);
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t bytes = row * k_cache.element_size();
  auto* kc = static_cast<char*>(k_cache.data_ptr());
  auto* vc = static_cast<char*>(v_cache.data_ptr());
  const auto* kp = static_cast<const char*>(k.data_ptr());
  const auto* vp = static_cast<const char*>(v.data_ptr());
  const int64_t ks = k.stride(0) * k.element_size(), vs = v.stride(0) * v.element_size();
  for (int64_t i = 0; i < t; ++i) {
    TORCH_CHECK(sp[i] >= 0 && sp[i] < capacity, "slot ", sp[i], " is outside the cache");
    std::memcpy(kc + sp[i] * bytes, kp + i * ks, bytes);
    std::memcpy(vc + sp[i] * bytes, vp + i * vs, bytes);
  }
}

}  // namespace

TORCH_LIBRARY(compress_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps, float offset) -> Tensor", &rms_norm);
  m.def("add_rms_norm_(Tensor(a!) residual, Tensor delta, Tensor weight, float eps, float offset) -> Tensor",
        &add_rms_norm_);
  m.def("act_mul(Tensor gate_up, int act) -> Tensor", &act_mul);
  m.def("int8_linear(Tensor x, Tensor w, Tensor scale) -> Tensor", &int8_linear);
  m.def("rope_(Tensor(a!) x, Tensor cos, Tensor sin, int heads) -> ()", &rope_);
  m.def("write_kv_(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor k, Tensor v, Tensor slots) -> ()", &write_kv_);
}
