"""Integer weights times int8 activations on CPU (runtime/kernels/cpu/qgemv.cpp): the decode step's linears.

``W8A8Linear`` carries a QuantLinear's own 4-bit or 8-bit integer codes, scales and zeros (nothing is
re-quantized) in the layout the kernel reads, and runs ``torch.ops.compress_cpu.w8a8_linear``. The
activations are rounded to int8 per block of 32 inside the kernel (as llama.cpp does for its Q4/Q8 dot
products), which is the only numeric difference from ``QuantLinear.forward``; ``w8a8_reference`` is the
same computation in torch, for the tests. The kernel exists for few rows (batch-1 and small-batch decode):
``runtime/kernels/qmatmul.py`` routes larger calls to a bf16 GEMM.

NF4 codes stay 4 bits a weight: the kernel maps each through a 16-entry table (:func:`nf4_table`) to the
8-bit code ``round(127 * NF4[q]) + 128`` with zero point 128 and scale ``absmax / 127``; the table's rounding
moves a weight by at most 1/254 of its group's absmax, a tenth of NF4's own finest half-step (0.04).
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from compress.qlinear import QuantLinear
from compress.quant import nf4_codebook

BLOCK = 32  # activation quantization block (qgemv.cpp's QB)


@functools.cache
def available() -> bool:
    """Whether the loaded CPU kernels were built with AVX512-VNNI (runtime/kernels/cpu_ext.py loads them)."""
    try:
        return bool(torch.ops.compress_cpu.has_vnni())
    except (RuntimeError, AttributeError):
        return False


def pack_tiles(codes: Tensor, bits: int) -> Tensor:
    """codes [N, K] (0..2^bits-1, K a multiple of 32) -> uint8 [ceil(N/16), K*16*bits/8] as qgemv.cpp reads them.

    Rows in tiles of 16; per tile, per group of 8 columns, 64 bytes (4-bit: byte 4r+i = q[r, 8p+i] | q[r, 8p+4+i]
    << 4) or 2 x 64 bytes (8-bit: q[r, 8p+i], then q[r, 8p+4+i]); padded rows are code 0.
    """
    n, k = codes.shape
    assert k % BLOCK == 0, k
    c = F.pad(codes.to(torch.uint8), (0, 0, 0, -n % 16))
    c = c.reshape(-1, 16, k // 8, 2, 4)  # [T, row, p, half, i]
    if bits == 4:
        c = c[:, :, :, 0] | (c[:, :, :, 1] << 4)  # [T, row, p, i]
        return c.permute(0, 2, 1, 3).reshape(c.shape[0], -1).contiguous()
    assert bits == 8
    return c.permute(0, 2, 3, 1, 4).reshape(c.shape[0], -1).contiguous()  # [T, p, half, row, i]


def tile_rows(t: Tensor) -> Tensor:
    """Per-row, per-group values [N, G] -> [ceil(N/16), G, 16] (padded rows 0), the layout of the scales."""
    n, g = t.shape
    return F.pad(t.float(), (0, 0, 0, -n % 16)).reshape(-1, 16, g).transpose(1, 2).contiguous()


def quantize_activations(x: Tensor) -> tuple[Tensor, Tensor]:
    """x [M, K] -> (int8 codes as fp32 [M, K], scale per block of 32 [M, K/32]), as the kernel rounds them."""
    xb = x.float().reshape(x.shape[0], -1, BLOCK)
    s = xb.abs().amax(-1) / 127.0
    inv = torch.where(s > 0, 1.0 / s, torch.zeros_like(s))
    return torch.round(xb * inv[..., None]).reshape(x.shape), s


NF4_UNIT = 127.0  # the table's codes are NF4 values in units of 1/127 of the group's absmax, offset by 128


def nf4_table() -> Tensor:
    """uint8 [16]: the 8-bit code each NF4 code stands for in the kernel (zero point 128)."""
    return (torch.round(nf4_codebook() * NF4_UNIT) + 128).to(torch.uint8)


def kernel_codes(ql: QuantLinear) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """(codes [N, K], scale [N, G], zero [N, G] in code units, lut or None): what the kernel multiplies."""
    s, scale = ql.scheme, ql.scales.float()
    if s.format == "nf4":
        return ql.codes(), scale / NF4_UNIT, torch.full_like(scale, 128.0), nf4_table()
    zero = ql.qzeros.float() if ql.qzeros is not None else torch.full_like(scale, s.sym_zero)
    return ql.codes(), scale, zero, None


def w8a8_reference(x: Tensor, codes: Tensor, scale: Tensor, zero: Tensor, group: int) -> Tensor:
    """The kernel's result in torch: x [M, K], codes/zero [N, K]/[N, G] in code units, scale [N, G]; fp32."""
    xq, sa = quantize_activations(x)
    m, k = x.shape
    n = codes.shape[0]
    prod = torch.einsum("mbi,nbi->mnb", xq.reshape(m, -1, BLOCK), codes.float().reshape(n, -1, BLOCK))
    ws = scale.float().repeat_interleave(group // BLOCK, dim=1)  # [N, K/32]
    y = (prod * ws[None] * sa[:, None, :]).sum(-1)
    gsum = (xq.reshape(m, -1, BLOCK).sum(-1) * sa).reshape(m, -1, group // BLOCK).sum(-1)  # [M, G]
    return y - gsum @ (scale.float() * zero.float()).T


def fits(ql: QuantLinear) -> bool:
    """Whether the kernel can carry ``ql``: 4- or 8-bit integer codes in groups (or channels) of multiples of 32
    (act-order groups must also fold into contiguous ones: runtime/kernels/qmatmul.py checks that)."""
    s = ql.scheme
    return ((s.format == "int" and s.bits in (4, 8)) or s.format == "nf4") and s.group(ql.in_features) % BLOCK == 0


class W8A8Linear(nn.Module):
    """A 4-bit or 8-bit integer or an NF4 QuantLinear (any group multiple of 32, act-order) for qgemv.cpp."""

    path = "w8a8"

    def __init__(self, ql: QuantLinear, perm: Tensor | None = None):
        super().__init__()
        s = ql.scheme
        assert fits(ql), s
        self.in_features, self.out_features, self.bits = ql.in_features, ql.out_features, s.bits
        self.group = s.group(ql.in_features)
        assert self.group % BLOCK == 0, self.group
        n_groups = s.n_groups(ql.in_features)
        self.k_pad = n_groups * self.group - ql.in_features  # a ragged last group: zero inputs meet any code
        self.perm = perm  # act-order: input columns in group order
        codes, scale, zero, self.lut = kernel_codes(ql)
        if perm is not None:
            codes = codes[:, perm]
        self.register_buffer("weight", pack_tiles(F.pad(codes, (0, self.k_pad)), s.bits))
        self.register_buffer("scale", tile_rows(scale))
        self.register_buffer("szero", tile_rows(scale * zero))
        self.bias = None if ql.bias is None else ql.bias.detach().float()
        self.direct = perm is None and not self.k_pad and self.bias is None  # the decode step's case
        # the op's arguments after x, as a plain attribute: buffer lookups through nn.Module cost ~1 us each,
        # a noticeable share of a ~15 us call
        self._args = (self.weight, self.scale, self.szero, self.bits, self.group, self.out_features, self.lut)
        self._op = torch.ops.compress_cpu.w8a8_linear.default

    def forward(self, x: Tensor) -> Tensor:
        if self.direct and x.dim() == 2:
            return self._op(x, *self._args)
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if self.perm is not None:
            x2 = x2.index_select(1, self.perm)
        if self.k_pad:
            x2 = F.pad(x2, (0, self.k_pad))
        y = self._op(x2.contiguous(), *self._args)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*lead, self.out_features)
