"""Integer weights times int8 activations on CPU (runtime/kernels/cpu/qgemv.cpp): the decode step's linears.

``W8A8Linear`` carries a QuantLinear's own 4-bit or 8-bit integer codes (nothing is re-quantized) in the layout
the kernel reads, with each group's scale and scale * zero in fp16 (:func:`half_scales`: 2 bytes each, where
batch-1 decode is bound by the bytes it reads), and runs ``torch.ops.compress_cpu.w8a8_linear``. The
activations are rounded to int8 per block of 32 inside the kernel (as llama.cpp does for its Q4/Q8 dot
products), which with the fp16 rounding of those two numbers (at most 2^-11 of each) is the only difference
from ``QuantLinear.forward``; ``w8a8_reference`` is the same computation in torch, for the tests. The kernel was
made for few rows (batch-1 and small-batch decode); without AMX it also beats oneDNN's bf16 GEMM on many, and
with AMX ``runtime/kernels/qmatmul.py`` routes larger calls to a bf16 GEMM on the weight dequantized into a
shared buffer (``ScratchLinear``, tile_dequant.cpp).

NF4 codes stay 4 bits a weight: the kernel maps each through a 16-entry table (:func:`nf4_table`) to the
8-bit code ``round(127 * NF4[q]) + 128`` with zero point 128 and scale ``absmax / 127``; the table's rounding
moves a weight by at most 1/254 of its group's absmax, a tenth of NF4's own finest half-step (0.04).
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from compress.format.qlinear import QuantEmbedding, QuantLinear
from compress.format.quant import dequantize, nf4_codebook, unpack

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


SLAB_ROWS = 1024  # output rows unpacked and tiled per step (a multiple of 16)


def tile_codes(ql: QuantLinear, perm: Tensor | None, k_pad: int) -> Tensor:
    """:func:`pack_tiles` of ``ql``'s codes (columns permuted by ``perm``, ``k_pad`` zero columns added), built
    ``SLAB_ROWS`` rows at a time so that the unpacked codes' temporaries stay a slab's, not the weight's."""
    n, k, bits = ql.out_features, ql.in_features + k_pad, ql.scheme.bits
    tiles = torch.empty(-(-n // 16), k * 2 * bits, dtype=torch.uint8)
    for s in range(0, n, SLAB_ROWS):
        codes = unpack(ql.qweight[s:s + SLAB_ROWS], bits, ql.in_features)  # [rows, in]
        tiles[s // 16:(s + codes.shape[0] + 15) // 16] = pack_tiles(
            F.pad(codes if perm is None else codes[:, perm], (0, k_pad)), bits)
    return tiles


def tile_rows(t: Tensor) -> Tensor:
    """Per-row, per-group values [N, G] -> [ceil(N/16), G, 16] (padded rows 0), the layout of the scales."""
    n, g = t.shape
    return F.pad(t.float(), (0, 0, 0, -n % 16)).reshape(-1, 16, g).transpose(1, 2).contiguous()


def untile_rows(t: Tensor, n: int) -> Tensor:
    """:func:`tile_rows` undone: [T, G, 16] -> fp32 [n, G]."""
    return t.float().transpose(1, 2).reshape(-1, t.shape[1])[:n]


class HalfScales(NamedTuple):
    """A linear's tiled scale and scale * zero in fp16, both times ``2 ** e``; ``unscale`` = ``2 ** -e`` undoes it."""

    scale: Tensor
    szero: Tensor
    unscale: float


def half_scales(scale: Tensor, szero: Tensor) -> HalfScales:
    """fp32 [T, G, 16] -> fp16, 2 bytes a group each instead of 4 (batch-1 decode reads every byte of them). A
    power of two common to the linear puts its largest magnitude in [2^14, 2^15): fp16's normal range then spans 29
    binades below it, so tiny groups (an NF4 scale is absmax / 127) keep fp16's 11 bits rather than going subnormal;
    the kernels multiply their result by ``unscale``, which is exact."""
    top = max(scale.abs().max().item(), szero.abs().max().item())
    e = 15 - math.frexp(top)[1] if top > 0 else 0  # top = f * 2^x, f in [0.5, 1): top * 2^e in [2^14, 2^15)
    return HalfScales((scale * 2.0 ** e).half(), (szero * 2.0 ** e).half(), 2.0 ** -e)


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


def kernel_scales(ql: QuantLinear) -> tuple[Tensor, Tensor, Tensor | None]:
    """(scale [N, G], zero [N, G] in code units, lut or None): what the kernel multiplies the codes by."""
    s, scale = ql.scheme, ql.scales.float()
    if s.format == "nf4":
        return scale / NF4_UNIT, torch.full_like(scale, 128.0), nf4_table()
    zero = ql.qzeros.float() if ql.qzeros is not None else torch.full_like(scale, s.sym_zero)
    return scale, zero, None


def w8a8_reference(x: Tensor, codes: Tensor, scale: Tensor, szero: Tensor, group: int) -> Tensor:
    """The kernel's result in torch: x [M, K], codes [N, K], scale and scale * zero [N, G] (the kernel's own:
    :meth:`W8A8Linear.scales`); fp32."""
    xq, sa = quantize_activations(x)
    m, k = x.shape
    n = codes.shape[0]
    prod = torch.einsum("mbi,nbi->mnb", xq.reshape(m, -1, BLOCK), codes.float().reshape(n, -1, BLOCK))
    ws = scale.float().repeat_interleave(group // BLOCK, dim=1)  # [N, K/32]
    y = (prod * ws[None] * sa[:, None, :]).sum(-1)
    gsum = (xq.reshape(m, -1, BLOCK).sum(-1) * sa).reshape(m, -1, group // BLOCK).sum(-1)  # [M, G]
    return y - gsum @ szero.float().T


def dequant_tiles(weight: Tensor, scale: Tensor, szero: Tensor, bits: int, group: int, n: int,
                  lut: Tensor | None = None, unscale: float = 1.0) -> Tensor:
    """The fp32 weight ``[n, K]`` that tiles (:func:`pack_tiles`) and their ``scale``/``szero`` [T, G, 16] (fp16 times
    ``1 / unscale``, :func:`half_scales`) stand for: ``code * scale - scale * zero``, the kernel's numbers
    (tile_dequant.cpp's torch reference)."""
    t = weight.shape[0]
    k = weight.shape[1] * 8 // (16 * bits)
    if bits == 4:
        b = weight.view(t, k // 8, 16, 4)  # [T, p, row, i]
        c = torch.stack([b & 15, b >> 4], dim=3)  # [T, p, row, half, i]: columns 8p + 4 half + i
    else:
        c = weight.view(t, k // 8, 2, 16, 4).transpose(2, 3)  # [T, p, half, row, i] -> [T, p, row, half, i]
    if lut is not None:
        c = lut[c.long()]
    codes = c.permute(0, 2, 1, 3, 4).reshape(t * 16, k).float()  # [T * 16, K]
    s, sz = ((untile_rows(v, t * 16) * unscale).repeat_interleave(group, dim=1) for v in (scale, szero))
    return (codes * s - sz)[:n]


def fits(ql: QuantLinear) -> bool:
    """Whether the kernel can carry ``ql``: 4- or 8-bit integer codes in groups (or channels) of multiples of 32
    (act-order groups must also fold into contiguous ones: runtime/kernels/qmatmul.py checks that)."""
    s = ql.scheme
    return ((s.format == "int" and s.bits in (4, 8)) or s.format == "nf4") and s.group(ql.in_features) % BLOCK == 0


class W8A8Linear(nn.Module):
    """A 4-bit or 8-bit integer or an NF4 QuantLinear (any group multiple of 32, act-order) for qgemv.cpp."""

    path = "w8a8"

    def __init__(self, ql: QuantLinear, perm: Tensor | None = None, tiles: Tensor | None = None):
        super().__init__()
        s = ql.scheme
        assert fits(ql), s
        self.in_features, self.out_features, self.bits = ql.in_features, ql.out_features, s.bits
        self.group = s.group(ql.in_features)
        assert self.group % BLOCK == 0, self.group
        n_groups = s.n_groups(ql.in_features)
        self.k_pad = n_groups * self.group - ql.in_features  # a ragged last group: zero inputs meet any code
        self.perm = perm  # act-order: input columns in group order
        scale, zero, self.lut = kernel_scales(ql)
        # ``tiles``: pack_tiles of the codes, built by the caller (runtime/kernels/lm_head.py)
        self.register_buffer("weight", tile_codes(ql, perm, self.k_pad) if tiles is None else tiles)
        half = half_scales(tile_rows(scale), tile_rows(scale * zero))  # fp16 [T, G, 16] each
        self.register_buffer("scale", half.scale)
        self.register_buffer("szero", half.szero)
        self.unscale = half.unscale
        self.bias = None if ql.bias is None else ql.bias.detach().float()
        self.direct = perm is None and not self.k_pad and self.bias is None  # the decode step's case
        self._op = torch.ops.compress_cpu.w8a8_linear.default
        self.rebind(self.weight, self.scale, self.szero)

    def packed(self) -> tuple[Tensor, Tensor, Tensor]:
        """The buffers the kernel streams: tiles, scales, scaled zeros."""
        return self.weight, self.scale, self.szero

    def rebind(self, weight: Tensor, scale: Tensor, szero: Tensor) -> None:
        """Run from these buffers (the same values, held elsewhere: runtime/hugepages.py)."""
        self.weight, self.scale, self.szero = weight, scale, szero
        # the op's arguments after x, as a plain attribute: buffer lookups through nn.Module cost ~1 us each,
        # a noticeable share of a ~15 us call
        self._args = (self.weight, self.scale, self.szero, self.unscale, self.bits, self.group, self.out_features,
                      self.lut)

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

    def dequantize_into(self, out: Tensor) -> Tensor:
        """``out`` [N, K padded] (bf16 or fp32) <- this layer's weight, input columns in the kernel's order."""
        torch.ops.compress_cpu.w8a8_dequant_(out, *self._args[:4], self.bits, self.group, self.lut)
        return out

    def scales(self) -> tuple[Tensor, Tensor]:
        """(scale, scale * zero) fp32 [N, G]: the numbers the kernels multiply by (fp16-rounded, unscaled)."""
        return tuple(untile_rows(v, self.out_features) * self.unscale for v in (self.scale, self.szero))


class Scratch:
    """One buffer that every large call of a model's linears dequantizes its weight into, in turn (a forward runs
    one linear at a time): it grows to the largest linear on the first such call, never to the model's size."""

    def __init__(self, dtype: torch.dtype = torch.bfloat16):
        self.buf = torch.empty(0, dtype=dtype)

    def take(self, rows: int, cols: int) -> Tensor:
        if self.buf.numel() < rows * cols:
            self.buf = torch.empty(rows * cols, dtype=self.buf.dtype)
        return self.buf[:rows * cols].view(rows, cols)


class ScratchLinear(nn.Module):
    """A W8A8Linear's weight dequantized into a shared :class:`Scratch` for each call, then a bf16 GEMM: the speed
    of a dense copy for calls of many rows (prefill, batched decoding) without keeping one."""

    path = "scratch"

    def __init__(self, kernel: W8A8Linear, scratch: Scratch):
        super().__init__()
        self.kernel, self.scratch = kernel, scratch
        self.in_features, self.out_features = kernel.in_features, kernel.out_features
        self.bias = None if kernel.bias is None else kernel.bias.to(scratch.buf.dtype)

    def forward(self, x: Tensor) -> Tensor:
        k = self.kernel
        lead, dtype = x.shape[:-1], x.dtype
        x2 = x.reshape(-1, self.in_features).to(self.scratch.buf.dtype)
        if k.perm is not None:
            x2 = x2.index_select(1, k.perm)
        if k.k_pad:
            x2 = F.pad(x2, (0, k.k_pad))
        w = k.dequantize_into(self.scratch.take(self.out_features, x2.shape[1]))
        return F.linear(x2, w, self.bias).to(dtype).reshape(*lead, self.out_features)


def gather_codes(tiles: Tensor, ids: Tensor, bits: int, cols: int) -> Tensor:
    """The codes uint8 [N, cols] of rows ``ids`` [N] of the weight that ``tiles`` (:func:`pack_tiles`) hold."""
    t, r = ids // 16, ids % 16
    n = ids.shape[0]
    picked = tiles.index_select(0, t)  # [N, tile bytes]: only the tiles of the asked rows
    at = torch.arange(n, device=ids.device)
    if bits == 4:
        b = picked.view(n, cols // 8, 16, 4)[at, :, r]  # [N, p, i]
        c = torch.stack([b & 15, b >> 4], dim=2)  # [N, p, half, i]
    else:
        c = picked.view(n, cols // 8, 2, 16, 4)[at, :, :, r]  # [N, p, half, i]
    return c.reshape(n, cols)


class TiledEmbedding(nn.Module):
    """A quantized embedding whose codes live in its tied head's w8a8 tiles (runtime/kernels/lm_head.py): a lookup
    gathers its rows' codes from the tiles and dequantizes them with the embedding's own scales and zeros, the
    numbers ``QuantEmbedding`` computes."""

    def __init__(self, head: W8A8Linear, embed: QuantEmbedding):
        super().__init__()
        assert head.out_features == embed.num_embeddings and head.in_features == embed.embedding_dim
        self.head = [head]  # a plain list: the tiles are the head's buffers, not this module's
        self.num_embeddings, self.embedding_dim, self.scheme = embed.num_embeddings, embed.embedding_dim, embed.scheme
        self.scales, self.qzeros = embed.scales, embed.qzeros  # [vocab, G]: small, kept as they are
        self.compute_dtype, self.embed_scale = embed.compute_dtype, embed.embed_scale

    def forward(self, ids: Tensor) -> Tensor:
        flat = ids.reshape(-1)
        q = gather_codes(self.head[0].weight, flat, self.scheme.bits, self.embedding_dim)
        zero = None if self.qzeros is None else self.qzeros.index_select(0, flat)
        x = dequantize(q, self.scales.index_select(0, flat), zero, self.scheme, None, self.compute_dtype)
        x = x.reshape(*ids.shape, self.embedding_dim)
        return x if self.embed_scale is None else x * torch.tensor(self.embed_scale).to(x.dtype)
