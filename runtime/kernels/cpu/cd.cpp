// Coordinate descent over a quantized weight's codes after GPTQ (compress/methods/common/coordinate_descent.py,
// which holds the reference loop and the reasoning). The quadratic error sum_rows e H e^T splits into one term per
// output row, so each row runs its sweeps alone: one thread a slab of rows, each row's E H kept in g's row and
// updated by an axpy of H's row j whenever the row's code in column j moves. Every float operation is the torch
// loop's, in its order (-ffp-contract=off), so the codes come out bit for bit the same; a row stops at its first
// sweep that moves nothing, where the torch loop runs on while any row moves (a row that did not move never will).
#include "common.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <optional>

namespace {

using namespace compress_cpu;

// wq [out, in] fp32: the dequantized codes; g [out, in] fp32: (W - wq) H; q [out, in] uint8: the codes;
// s, z [out, groups] fp32 (z absent: sym_zero); group [in] int64: each column's group; h [in, in] fp32.
// wq, g and q are updated in place; returns how many codes moved.
int64_t cd_sweeps_(at::Tensor& wq, at::Tensor& g, at::Tensor& q, const at::Tensor& s, const std::optional<at::Tensor>& z,
                   const at::Tensor& group, const at::Tensor& h, int64_t maxq, double sym_zero, int64_t passes) {
  check_cpu(wq, "wq");
  check_cpu(g, "g");
  check_cpu(q, "q");
  check_cpu(s, "s");
  check_cpu(group, "group");
  check_cpu(h, "h");
  TORCH_CHECK(wq.scalar_type() == at::kFloat && g.scalar_type() == at::kFloat && s.scalar_type() == at::kFloat &&
                  h.scalar_type() == at::kFloat && q.scalar_type() == at::kByte && group.scalar_type() == at::kLong,
              "cd_sweeps_: fp32 wq, g, s, h; uint8 q; int64 group");
  const int64_t out = wq.size(0), in = wq.size(1), groups = s.size(1);
  TORCH_CHECK(g.sizes() == wq.sizes() && q.sizes() == wq.sizes() && h.size(0) == in && h.size(1) == in &&
                  group.numel() == in && s.size(0) == out && wq.is_contiguous() && g.is_contiguous() &&
                  q.is_contiguous() && s.is_contiguous() && h.is_contiguous() && group.is_contiguous(),
              "cd_sweeps_: contiguous wq, g, q [out, in], s [out, groups], h [in, in], group [in]");
  const bool zeros = z.has_value() && z->defined();
  if (zeros)
    TORCH_CHECK(z->scalar_type() == at::kFloat && z->sizes() == s.sizes() && z->is_contiguous(),
                "cd_sweeps_: z fp32 like s");
  float* wp = wq.data_ptr<float>();
  float* gp = g.data_ptr<float>();
  uint8_t* qp = q.data_ptr<uint8_t>();
  const float* sp = s.data_ptr<float>();
  const float* zp = zeros ? z->data_ptr<float>() : nullptr;
  const int64_t* gi = group.data_ptr<int64_t>();
  const float* hp = h.data_ptr<float>();
  const float top = static_cast<float>(maxq), sz = static_cast<float>(sym_zero);
  std::atomic<int64_t> moved{0};
  at::parallel_for(0, out, 1, [&](int64_t r0, int64_t r1) {
    int64_t local = 0;
    for (int64_t r = r0; r < r1; ++r) {
      float* w = wp + r * in;
      float* gr = gp + r * in;
      uint8_t* qr = qp + r * in;
      for (int64_t pass = 0; pass < passes; ++pass) {
        int64_t row_moved = 0;
        for (int64_t j = 0; j < in; ++j) {
          const float sv = sp[r * groups + gi[j]];
          const float zv = zeros ? zp[r * groups + gi[j]] : sz;
          const float t = w[j] + gr[j] / hp[j * in + j];
          const float code = std::min(std::max(std::nearbyint(t / sv) + zv, 0.0f), top);
          if (code == static_cast<float>(qr[j])) continue;
          const float now = (code - zv) * sv;
          const float de = w[j] - now;
          const float* hj = hp + j * in;
          for (int64_t k = 0; k < in; ++k) gr[k] += de * hj[k];
          w[j] = now;
          qr[j] = static_cast<uint8_t>(code);
          ++row_moved;
        }
        local += row_moved;
        if (!row_moved) break;
      }
    }
    moved += local;
  });
  return moved.load();
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(compress_cpu, m) {
  m.def("cd_sweeps_(Tensor(a!) wq, Tensor(b!) g, Tensor(c!) q, Tensor s, Tensor? z, Tensor group, Tensor h, int maxq, "
        "float sym_zero, int passes) -> int", &cd_sweeps_);
}
