"""Quantized matmul on CPU: QuantLinear weights turned, once at load, into the fastest correct kernel.

Paths (``prepare_linear`` picks one per layer; ``forward`` of each equals ``QuantLinear.forward`` up to
the rounding of its compute dtype):

- ``int4pack``: ``aten._weight_int4pack_mm_for_cpu`` for 4-bit integer codes with group sizes 32, 64,
  128 or 256 (asymmetric or symmetric). The kernel computes ``(q - 8) * scale + zero_f`` per group, so
  our ``(q - z) * scale`` maps to ``zero_f = (8 - z) * scale``. It wants ``K`` a multiple of the group
  size and ``N`` a multiple of 16: a ragged last group and odd ``N`` are padded (zero input columns,
  dropped output rows), act-order ``g_idx`` becomes a column permutation of the input. It runs with
  bf16 activations (its fp32 path is many times slower), so outputs carry bf16 rounding.
- ``int8pack``: ``aten._weight_int8pack_mm`` for 8-bit per-channel codes: ``q - 128`` as int8 with the
  channel scale; an asymmetric zero adds ``rowsum(x) * (128 - z) * scale``. bf16 activations; ``K``
  padded to a multiple of 64 (the kernel misbehaves otherwise).
- ``w8a8`` (runtime/kernels/w8a8.py, with the fused CPU kernels on a CPU with AVX512-VNNI): 4- and 8-bit
  integer codes and NF4 codes (4 bits a weight, through a 16-entry table in the register) in any group that
  is a multiple of 32, act-order included, times activations rounded to
  int8 per block of 32 inside the kernel (llama.cpp's Q8 activations); integer dot products (vpdpbusd).
  It replaces int4pack/int8pack where it runs: about 3x faster than int4pack at batch 1 on the AMD EPYC.
- ``dense``: the weight dequantized once into the compute dtype (exactly ``QuantLinear``'s numbers),
  for every other format (2/3-bit, grouped int8; nf4 without VNNI) and for ``quant_kernel="dequant"``.

Plain (unquantized) linears of a bf16 model run as ``mkldnn``: the weight reordered once into oneDNN's
blocked layout (``mkldnn._reorder_linear_weight``), which runs the same bf16 products as ``F.linear``
faster (about 1.5x at batch 1, 1.4x at 32, one core of this AMX CPU). fp32 models keep ``F.linear``
(bit-identical to transformers') except for decode calls of a few rows with the fused kernels loaded, which
run ``GemvLinear`` (runtime/kernels/fp_gemv.py: 2.3x the bytes per second, fp32 rounding apart).

aten's packed kernels are made for few rows: past a handful of tokens per call (batched decoding, prefill) a bf16
GEMM on oneDNN's AMX path beats them several times over. What runs the calls of many rows beside a packed kernel
(:func:`large_rows_kernel`, routed by row count in ``HybridLinear``):

- ``mode="auto"`` (the default): nothing but the packed kernel where it is fastest anyway (w8a8 on a CPU without
  AMX: the VNNI kernel beat oneDNN's bf16 GEMM at 32 to 512 rows on the AMD EPYC, 88 vs 128 ms for a 9728 x 896
  linear at 512 rows); w8a8 with AMX: the weight dequantized for each such call into one scratch buffer the
  model's linears share (``w8a8.ScratchLinear``: the size of the largest linear, not of the model); aten's
  int4pack/int8pack (no VNNI kernels): a persistent bf16 copy, as ``"hybrid"``.
- ``mode="hybrid"``: a persistent bf16 copy of every packed linear, dequantized once from the same integers
  (``MkldnnLinear``): 2 bytes a weight more (4x the int4 codes) for the fastest large calls on AMX.
- ``mode="packed"``: only the packed weight (least memory).

Measured on this CPU (one core, SmolLM2-135M's 120 layer linears, ms per forward; int4 group 64):

    rows   fp32 F.linear   bf16 oneDNN   int4pack   int8pack
    1          37.0           26.4         10.8       24.3
    8            -            26.2         26.6         -
    32        107.7           31.6         91.3      121.7
    256       369.5           69.4        698.8      866.4

Nothing is re-quantized: the packed layouts are built from the stored integers, scales and zeros.
"""
from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from compress.format.qlinear import QuantLinear
from compress.format.quant import Scheme
from runtime.config import LM_HEADS
from runtime.cpu import cpu_info
from runtime.kernels import w8a8
from runtime.kernels.fp_gemv import GemvLinear

log = logging.getLogger(__name__)

INT4_GROUPS = (32, 64, 128, 256)
KERNEL_DTYPE = torch.bfloat16


def _act_order_perm(ql: QuantLinear) -> Tensor | None:
    """Input-column order that makes act-order groups contiguous, or None when already natural."""
    if ql.g_idx is None:
        return None
    g = ql.g_idx.long()
    gs = ql.scheme.group(ql.in_features)
    perm = torch.sort(g, stable=True).indices
    counts = torch.bincount(g, minlength=ql.scheme.n_groups(ql.in_features))
    if (counts[:-1] != gs).any() or counts[-1] > gs:
        raise ValueError("act-order groups are not of equal size; no packed layout")
    return None if torch.equal(perm, torch.arange(ql.in_features)) else perm


class DenseLinear(nn.Module):
    """The dequantized weight, kept in the compute dtype."""

    path = "dense"

    def __init__(self, ql: QuantLinear, dtype: torch.dtype):
        super().__init__()
        self.in_features, self.out_features = ql.in_features, ql.out_features
        self.register_buffer("weight", ql.dequantized_weight(torch.float32).to(dtype))
        self.bias = None if ql.bias is None else ql.bias.detach().to(dtype)

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight, self.bias)


class Int4PackedLinear(nn.Module):
    """4-bit codes in torch's CPU int4 packed layout, run by ``_weight_int4pack_mm_for_cpu``."""

    path = "int4pack"

    def __init__(self, ql: QuantLinear):
        super().__init__()
        s = ql.scheme
        assert s.bits == 4 and s.format == "int" and s.group_size in INT4_GROUPS
        self.in_features, self.out_features = ql.in_features, ql.out_features
        self.group = s.group_size
        perm = _act_order_perm(ql)
        self.perm = perm
        codes = ql.codes().to(torch.int32)  # [N, K]
        if perm is not None:
            codes = codes[:, perm]
        n_groups = s.n_groups(ql.in_features)
        self.k_pad = n_groups * self.group - ql.in_features
        n_pad = -ql.out_features % 16
        codes = F.pad(codes, (0, self.k_pad, 0, n_pad), value=8)  # padded weights meet zero inputs / are dropped
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.contiguous(), 1))
        scale = ql.scales.float()  # [N, G]
        zero = ql.qzeros.float() if ql.qzeros is not None else torch.full_like(scale, s.sym_zero)
        sz = torch.stack([scale, (8 - zero) * scale], dim=-1)  # [N, G, 2]
        sz = F.pad(sz, (0, 0, 0, 0, 0, n_pad))
        self.register_buffer("scale_zeros", sz.transpose(0, 1).contiguous().to(KERNEL_DTYPE))  # [G, N, 2]
        self.bias = None if ql.bias is None else ql.bias.detach().float()
        # nothing to permute, pad or add: a 2-D bf16 input goes straight to the kernel (the decode step's case)
        self.direct = perm is None and not self.k_pad and not n_pad and self.bias is None

    def forward(self, x: Tensor) -> Tensor:
        if self.direct and x.dim() == 2 and x.dtype == KERNEL_DTYPE:
            return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, self.group, self.scale_zeros)
        lead, dtype = x.shape[:-1], x.dtype
        x2 = x.reshape(-1, self.in_features).to(KERNEL_DTYPE)
        if self.perm is not None:
            x2 = x2.index_select(1, self.perm)
        if self.k_pad:
            x2 = F.pad(x2, (0, self.k_pad))
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.packed, self.group, self.scale_zeros)
        y = y[:, :self.out_features].to(dtype)
        if self.bias is not None:
            y = y + self.bias.to(dtype)
        return y.reshape(*lead, self.out_features)


class Int8PackedLinear(nn.Module):
    """8-bit per-channel codes as int8, run by ``_weight_int8pack_mm``."""

    path = "int8pack"

    def __init__(self, ql: QuantLinear, fused: bool = False):
        super().__init__()
        s = ql.scheme
        assert s.bits == 8 and s.format == "int" and s.n_groups(ql.in_features) == 1
        self.fused = fused  # runtime/kernels/cpu/fused_ops.cpp's int8_linear (fp32 accumulation) instead of aten's
        self.in_features, self.out_features = ql.in_features, ql.out_features
        self.k_pad = -ql.in_features % 64
        w8 = (ql.codes().to(torch.int16) - 128).to(torch.int8)  # exact: codes are 0..255
        self.register_buffer("weight", F.pad(w8, (0, self.k_pad)).contiguous())
        scale = ql.scales.float()[:, 0]
        self.register_buffer("scale", scale.to(KERNEL_DTYPE))
        self.register_buffer("scale_f32", scale)
        corr = None if ql.qzeros is None else (128 - ql.qzeros.float()[:, 0]) * scale
        self.correction = None if corr is None or not corr.any() else corr  # per output channel, fp32
        self.bias = None if ql.bias is None else ql.bias.detach().float()

    def forward(self, x: Tensor) -> Tensor:
        lead, dtype = x.shape[:-1], x.dtype
        x2 = x.reshape(-1, self.in_features)
        if self.fused:
            y = torch.ops.compress_cpu.int8_linear(x2, self.weight, self.scale_f32)
        else:
            xk = x2.to(KERNEL_DTYPE)
            if self.k_pad:
                xk = F.pad(xk, (0, self.k_pad))
            y = torch.ops.aten._weight_int8pack_mm(xk, self.weight, self.scale).to(dtype)
        if self.correction is not None:
            y = y + x2.float().sum(-1, keepdim=True).to(dtype) * self.correction.to(dtype)
        if self.bias is not None:
            y = y + self.bias.to(dtype)
        return y.reshape(*lead, self.out_features)


def groups_foldable(ql: QuantLinear) -> bool:
    """Whether a column permutation makes the (act-order) groups contiguous, as the packed layouts need."""
    try:
        _act_order_perm(ql)
    except ValueError:
        return False
    return True


def packed_path(ql: QuantLinear) -> str:
    """Which packed kernel can run ``ql`` ("int4pack", "int8pack"), or "dense"."""
    s = ql.scheme
    if s.format != "int":
        return "dense"
    if s.bits == 4 and s.group_size in INT4_GROUPS:
        return "int4pack" if groups_foldable(ql) else "dense"
    if s.bits == 8 and s.n_groups(ql.in_features) == 1:
        return "int8pack"
    return "dense"


# rows up to which the packed kernel beats a bf16 GEMM (crossover measured at about 8 for int4, 1 for aten's
# int8, 4 for the fused int8 kernel on the Xeon with AMX; w8a8 on the AMD EPYC without AMX: faster than oneDNN's
# bf16 GEMM up to 32 rows for the int4 linears, about equal at 32 for the int8 LM head)
HYBRID_MAX_ROWS = {"int4pack": 6, "int8pack": 1, "int8pack-fused": 4, "w8a8": 24, "w8a8-amx": 8}


PACKED_MODES = ("auto", "hybrid", "packed")


def prepare_linear(ql: QuantLinear, mode: str, dtype: torch.dtype, fused: bool = False, lean: bool = False,
                   scratch: w8a8.Scratch | None = None, tiles: Tensor | None = None) -> nn.Module:
    """The kernel module for one QuantLinear: ``mode`` "auto", "hybrid", "packed" (when the format allows) or
    "dequant"; ``fused``: the fused CPU kernels are loaded (runtime/kernels/cpu_ext.py) and may run it; ``lean``: no
    copy larger than the checkpoint's own codes (no int8 tiles of 4-bit codes); ``scratch``: the buffer the model's
    linears share for dequantized large calls (one of their own otherwise); ``tiles``: the w8a8 layout of ``ql``'s
    codes, already built (runtime/kernels/lm_head.py's tied head)."""
    path = packed_path(ql) if mode in PACKED_MODES else "dense"
    if (mode in PACKED_MODES and fused and w8a8.available() and w8a8.fits(ql) and groups_foldable(ql)
            and not (lean and ql.scheme.bits < 8)):
        path = "w8a8"
    if path == "dense":
        return DenseLinear(ql, dtype)
    if path == "w8a8":
        kernel = w8a8.W8A8Linear(ql, _act_order_perm(ql), tiles)
    else:
        kernel = Int4PackedLinear(ql) if path == "int4pack" else Int8PackedLinear(ql, fused)
    large = large_rows_kernel(mode, path)
    if large == "copy":
        dense = MkldnnLinear(ql.dequantized_weight(torch.float32), ql.bias)
        return HybridLinear(kernel, dense, hybrid_max_rows(path, fused))
    if large == "scratch":
        return HybridLinear(kernel, w8a8.ScratchLinear(kernel, scratch or w8a8.Scratch()), hybrid_max_rows(path, fused))
    return kernel


def large_rows_kernel(mode: str, path: str) -> str | None:
    """What runs a packed linear's calls of many rows: a persistent bf16 copy ("copy"), the weight dequantized
    into a shared scratch per call ("scratch"), or None (the packed kernel runs every call); see the module doc."""
    if mode not in ("auto", "hybrid") or not mkldnn_bf16_available():
        return None
    if mode == "hybrid" or path != "w8a8":  # aten's int4pack/int8pack layouts have no scratch dequantizer
        return "copy"
    return "scratch" if cpu_info().amx_bf16 else None


def hybrid_max_rows(path: str, fused: bool) -> int:
    if path == "w8a8":  # its rows share one pass over the weights; a bf16 GEMM on AMX catches up sooner
        return HYBRID_MAX_ROWS["w8a8-amx" if cpu_info().amx_bf16 else "w8a8"]
    return HYBRID_MAX_ROWS[path + ("-fused" if fused and path == "int8pack" else "")]


class MkldnnLinear(nn.Module):
    """A bf16 weight prepacked for oneDNN (same products as ``F.linear``)."""

    path = "mkldnn"

    def __init__(self, weight: Tensor, bias: Tensor | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().to(torch.bfloat16).contiguous(), None)
        self.bias = None if bias is None else bias.detach().to(torch.bfloat16)

    def forward(self, x: Tensor) -> Tensor:
        if x.dtype != torch.bfloat16:  # fp32 engines: bf16 inside, like the packed integer kernels
            return torch.ops.mkldnn._linear_pointwise(x.to(torch.bfloat16), self.packed, self.bias, "none", [],
                                                      "").to(x.dtype)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


class HybridLinear(nn.Module):
    """A packed integer kernel for calls of at most ``max_rows`` rows, a bf16 GEMM for larger ones."""

    def __init__(self, small: nn.Module, large: nn.Module, max_rows: int):
        super().__init__()
        self.small, self.large, self.max_rows = small, large, max_rows
        self.in_features, self.out_features = small.in_features, small.out_features
        self.path = f"{small.path}+{large.path}"
        self._forwards = (small.forward, large.forward)  # plain attributes: no nn.Module lookup per call

    def forward(self, x: Tensor) -> Tensor:
        return self._forwards[x.numel() // self.in_features > self.max_rows](x)


@functools.cache
def mkldnn_bf16_available() -> bool:
    """Whether this torch/CPU runs prepacked bf16 linears (checked on a tiny example)."""
    try:
        lin = MkldnnLinear(torch.ones(16, 32), None)
        return bool(lin(torch.ones(2, 32, dtype=torch.bfloat16)).eq(32).all())
    except (RuntimeError, AttributeError):
        return False


def pack_dense_linears(model: nn.Module, dtype: torch.dtype, fused: bool = False) -> int:
    """Swap every plain ``nn.Linear`` for its CPU kernel: bf16 -> ``MkldnnLinear``, fp32 with the fused
    kernels loaded -> ``GemvLinear`` (runtime/kernels/fp_gemv.py); returns how many."""
    kernel_type = {torch.bfloat16: MkldnnLinear if mkldnn_bf16_available() else None,
                   torch.float32: GemvLinear if fused else None}.get(dtype)
    if kernel_type is None:
        if dtype == torch.bfloat16:
            log.info("prepacked bf16 linears unavailable here; using F.linear")
        return 0
    n = 0
    for name, module in list(model.named_modules()):
        if type(module) is nn.Linear and module.weight.dtype == dtype:
            kernel = kernel_type(module.weight, module.bias)
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, kernel)
            n += 1
    return n


class TritonLinear(nn.Module):
    """CUDA: the packed weight read directly by runtime/kernels/triton_qmatmul.py."""

    path = "triton"

    def __init__(self, ql: QuantLinear):
        super().__init__()
        self.ql = ql

    def forward(self, x: Tensor) -> Tensor:
        from runtime.kernels.triton_qmatmul import triton_qmatmul

        q = self.ql
        return triton_qmatmul(x, q.qweight, q.scales, q.qzeros, q.scheme, q.in_features, q.g_idx,
                              None if q.bias is None else q.bias)


# "auto"/"hybrid" add to the codes: int8 tiles of each weight for the VNNI kernel (1 byte a weight), and for "hybrid"
# (or "auto" without the VNNI kernels) a bf16 copy for large calls (2 bytes a weight); only while what they add
# takes at most this share of the memory free at load
COPY_BUDGET = 0.25


def added_bytes_per_weight(mode: str, fused: bool) -> int:
    """What ``mode`` keeps beside a quantized weight's codes, per weight: the VNNI kernel's int8 tiles, and a bf16
    copy where large calls run dense (:func:`large_rows_kernel`'s "copy")."""
    vnni = fused and w8a8.available()
    return (1 if vnni else 0) + (2 if mode == "hybrid" or not vnni else 0)


def too_large_for_copies(model: nn.Module, mode: str = "auto", fused: bool = True) -> bool:
    """Whether what ``mode`` adds beside ``model``'s quantized codes would exceed ``COPY_BUDGET`` of free memory."""
    from compress.format.host import available_bytes, gib

    weights = sum(m.in_features * m.out_features for m in model.modules() if isinstance(m, QuantLinear))
    copies = weights * added_bytes_per_weight(mode, fused)
    avail = available_bytes()
    if avail is None or copies <= COPY_BUDGET * avail:
        return False
    log.info("quantized weights served from their packed codes only: the %s kernels' copies would take %s, more "
             "than %.0f%% of the %s free", mode, gib(copies), 100 * COPY_BUDGET, gib(avail))
    return True
