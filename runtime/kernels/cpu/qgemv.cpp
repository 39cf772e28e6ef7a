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
// The group's scale and scale * zero are fp16 (w8a8.py's half_scales): 4.5 bits a 4-bit weight in groups of 64,
// not 5, where batch-1 decode is bound by the bytes it reads.
#include "qgemv.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <optional>
#include <vector>

namespace {

using namespace compress_cpu;

// y [M, N] = x [M, K] @ dequant(w)^T, y in x's dtype. w: the codes of N rows padded to tiles of 16, as uint8
// [tiles, K * 16 * bits / 8] in qmatmul.py's pack_tiles layout; scale and szero = scale * zero: fp16
// [tiles, G, 16] (G = K / group), both times 1 / unscale. K a multiple of 32, the group a multiple of 32 dividing
// K. lut: uint8 [16], 4-bit codes only: each code q stands for lut[q] (zero and scale in lut units).
at::Tensor w8a8_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale, const at::Tensor& szero,
                       double unscale, int64_t bits, int64_t group, int64_t n_out,
                       const std::optional<at::Tensor>& lut) {
  TORCH_CHECK(has_vnni(), "w8a8_linear needs AVX512-VNNI, which this build of the kernels lacks");
  check_cpu(x, "x");
  check_cpu(w, "w");
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
  const uint16_t* scale_p = half_scales(scale, tiles, ng, "scale");
  const uint16_t* szero_p = half_scales(szero, tiles, ng, "szero");
  auto out = at::empty({m, n_out}, x.options());
#ifdef COMPRESS_VNNI
  const int64_t nb = k / QB;
  std::vector<int8_t> xq(m * k);
  std::vector<float> sa(m * nb), gsum(m * ng);
  std::vector<int32_t> gidx(nb);  // weight group of each 32-block
  for (int64_t b = 0; b < nb; ++b) gidx[b] = static_cast<int32_t>(b * QB / group);
  const QWeight qw{w.data_ptr<uint8_t>(), scale_p, szero_p, static_cast<float>(unscale), lut_p, bits, group, k,
                   n_out, tiles};
  DISPATCH_F32_BF16(x.scalar_type(), "w8a8_linear", [&] {
    quantize_rows<scalar_t>(x.data_ptr<scalar_t>(), m, k, group, xq.data(), sa.data(), gsum.data());
    at::parallel_for(0, tiles, 4, [&](int64_t begin, int64_t end) {
      gemv_range<scalar_t>(qw, xq.data(), sa.data(), gsum.data(), gidx.data(), out.data_ptr<scalar_t>(), m, begin,
                           end);
    });
  });
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(compress_cpu, m) {
  m.def("has_vnni() -> bool", &has_vnni);
  m.def("w8a8_linear(Tensor x, Tensor w, Tensor scale, Tensor szero, float unscale, int bits, int group, int n_out, "
        "Tensor? lut=None) -> Tensor", &w8a8_linear);
}
