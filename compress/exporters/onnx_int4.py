"""ONNX decoder whose quantized linears are ONNX Runtime ``com.microsoft::MatMulNBits`` (``--format onnx-int4``).

Each QuantLinear becomes a module calling the custom op ``compress_export::matmul_nbits``, which the
dynamo exporter translates straight into one MatMulNBits node (plus a Gather for act-order), carrying
the layer's own codes and fp16 scales:
- ``B``  uint8 [N, K_blocks, block / 2]: codes along K, two a byte, low nibble first; a ragged
  last block (K not a multiple of the block) is zero-padded, which ONNX Runtime supports natively.
- ``scales``  [N * K_blocks] in the graph dtype; ``zero_points`` uint8 [N * ceil(K_blocks / 2)], two
  4-bit zeros a byte, low nibble first (omitted for symmetric schemes: MatMulNBits' default is 8).
- Blocks must be 16..256 (ONNX Runtime's CPU kernel), so a group larger than that (or per-channel)
  is split into blocks that repeat its scale and zero: the same numbers, not a re-quantization.
- act-order: MatMulNBits' ``g_idx`` input is deprecated and ignored by the CPU kernel, so the
  columns are permuted to make groups contiguous and the activations are gathered to match
  (``x[..., perm] @ W[:, perm].T == x @ W.T``).

A quantized embedding (the checkpoint's ``embed``, exporters/common.py ``Tables``) becomes one
``com.microsoft::GatherBlockQuantized`` (ONNX Runtime >= 1.20; checked on 1.31) on its own 4- or 8-bit codes,
fp scales and uint8 zero points per block (``gather_axis`` 0, ``quantize_axis`` 1), so only the rows asked for are
dequantized; a tied head at 4 bits is MatMulNBits on the same codes (the file holds one copy). Codes whose groups do
not fit its blocks (3-bit, NF4, a 4-bit row of an odd number of blocks) are written dequantized, logged. An untied
quantized head is one more QuantLinear.
"""
from __future__ import annotations

import copy
import logging
import math
from pathlib import Path

import torch
from torch import Tensor, nn

from compress.format.checkpoint import set_module
from compress.exporters.common import Source, Tables, group_map, zeros_of
from compress.exporters.onnx_fp import write_onnx
from compress.exporters.packing import pack_nibbles, unpack_nibbles
from compress.format.qlinear import QuantLinear
from compress.format.quant import QuantizedWeight

BLOCKS = (256, 128, 64, 32, 16)  # block sizes ONNX Runtime's CPU MatMulNBits accepts
_OP = _GATHER = None
log = logging.getLogger(__name__)


def block_size(m: QuantLinear) -> int | None:
    """The MatMulNBits block for this layer's groups, or None when no allowed block fits them."""
    k, g = m.in_features, m.scheme.group(m.in_features)
    if g >= k:  # one group per row: any block, each repeating the row's scale
        return next((b for b in BLOCKS if b <= k), BLOCKS[-1])
    return next((b for b in BLOCKS if g % b == 0), None)


def column_order(m: QuantLinear) -> Tensor | None:
    """Permutation that makes every group contiguous (act-order only; None when already in order)."""
    if m.g_idx is None:
        return None
    perm = torch.argsort(m.g_idx.long(), stable=True)
    return None if torch.equal(perm, torch.arange(m.in_features)) else perm


def _block_groups(m: QuantLinear, block: int) -> tuple[Tensor, bool]:
    """Group of each block (by its first column) and whether every column of each block shares it."""
    gm = group_map(m)
    perm = column_order(m)
    if perm is not None:
        gm = gm[perm]
    k = m.in_features
    starts = torch.arange(math.ceil(k / block)) * block
    bg = gm[starts]
    return bg, bool((bg.repeat_interleave(block)[:k] == gm).all())


def check(m: QuantLinear) -> str | None:
    s = m.scheme
    if s.format != "int":
        return f"{s.format} codes are not on a uniform integer grid (MatMulNBits dequantizes linearly)"
    if s.bits != 4:
        return f"{s.bits}-bit: onnx-int4 carries 4-bit codes only"
    block = block_size(m)
    if block is None:
        return f"group_size {s.group_size} is not a multiple of 16 (MatMulNBits blocks are 16..256)"
    if not _block_groups(m, block)[1]:
        return "act-order map (g_idx) is not a permutation of whole groups"
    return None


def nbits_tensors(m: QuantLinear) -> dict[str, Tensor | int | None]:
    """MatMulNBits' B, scales and zero_points (plus the column permutation) for one layer."""
    n, k = m.out_features, m.in_features
    block = block_size(m)
    bg, ok = _block_groups(m, block)
    assert ok, "check() refuses this layer"
    kb = len(bg)
    q, perm = m.codes(), column_order(m)
    if perm is not None:
        q = q[:, perm]
    # q: [N, K] -> zero-padded [N, kb * block] -> [N, kb, block] -> [N, kb, block / 2]
    b = pack_nibbles(nn.functional.pad(q, (0, kb * block - k)).reshape(n, kb, block))
    zp = None
    if m.qzeros is not None:
        z = zeros_of(m)[:, bg]  # [N, kb]
        zp = pack_nibbles(nn.functional.pad(z, (0, kb % 2))).reshape(-1)  # [N * ceil(kb / 2)]
    return {"b": b, "scales": m.scales[:, bg].reshape(-1), "zero_points": zp, "perm": perm, "block": block}


def _reference(x: Tensor, b: Tensor, scales: Tensor, zero_points: Tensor | None, perm: Tensor | None,
               K: int, N: int, bits: int, block_size: int) -> Tensor:
    """MatMulNBits' math in torch: dequantize B block-wise and multiply (eager path of the custom op)."""
    kb = b.shape[1]
    q = unpack_nibbles(b).reshape(N, kb * block_size).float()  # [N, kb * block]
    s = scales.float().reshape(N, kb).repeat_interleave(block_size, dim=1)
    if zero_points is None:
        z = torch.full_like(s, 2 ** (bits - 1))
    else:
        z = unpack_nibbles(zero_points.reshape(N, -1))[:, :kb].float().repeat_interleave(block_size, dim=1)
    w = ((q - z) * s)[:, :K]
    if perm is not None:
        x = x.index_select(-1, perm)
    return nn.functional.linear(x.float(), w).to(x.dtype)


def _schema():
    import onnx.defs as d

    P, opt, attr = d.OpSchema.FormalParameter, d.OpSchema.FormalParameterOption.Optional, d.OpSchema.Attribute
    return d.OpSchema(
        "MatMulNBits", "com.microsoft", 1, "ONNX Runtime contrib op (declared here for onnxscript)",
        inputs=[P("A", "T1"), P("B", "T2"), P("scales", "T1"), P("zero_points", "T3", param_option=opt),
                P("g_idx", "T4", param_option=opt), P("bias", "T1", param_option=opt)],
        outputs=[P("Y", "T1")],
        type_constraints=[("T1", ["tensor(float)", "tensor(float16)"], ""), ("T2", ["tensor(uint8)"], ""),
                          ("T3", ["tensor(uint8)", "tensor(float)", "tensor(float16)"], ""),
                          ("T4", ["tensor(int32)"], "")],
        attributes=[attr(a, d.OpSchema.AttrType.INT, "") for a in ("K", "N", "bits", "block_size")]
        + [attr("accuracy_level", d.OpSchema.AttrType.INT, "", required=False)])


def matmul_nbits_op():
    """Register (once) and return the custom op that stands for MatMulNBits while tracing."""
    global _OP
    if _OP is None:
        op = torch.library.custom_op("compress_export::matmul_nbits", mutates_args=())(_reference)
        op.register_fake(lambda x, b, scales, zero_points, perm, K, N, bits, block_size:
                         x.new_empty(*x.shape[:-1], N))
        _OP = op
    return _OP


def translations() -> dict:
    """custom_translation_table: the custom op -> [Gather] + com.microsoft::MatMulNBits."""
    import onnxscript
    from onnxscript import opset18 as op

    nbits = onnxscript.values.Op(onnxscript.values.Opset("com.microsoft", 1), "MatMulNBits", _schema())

    def matmul_nbits(x, b, scales, zero_points=None, perm=None, K: int = 0, N: int = 0, bits: int = 4,
                     block_size: int = 32):
        if perm is not None:
            x = op.Gather(x, perm, axis=-1)
        inputs = (x, b, scales) if zero_points is None else (x, b, scales, zero_points)
        return nbits(*inputs, K=K, N=N, bits=bits, block_size=block_size, accuracy_level=0)

    gather = onnxscript.values.Op(onnxscript.values.Opset("com.microsoft", 1), "GatherBlockQuantized",
                                  _gather_schema())

    def gather_block_quantized(ids, data, scales, zero_points, bits: int = 4, block_size: int = 32):
        return gather(data, ids, scales, zero_points, gather_axis=0, quantize_axis=1, block_size=block_size,
                      bits=bits)

    return {matmul_nbits_op()._opoverload: matmul_nbits, gather_op()._opoverload: gather_block_quantized}


class NBitsLinear(nn.Module):
    """A linear layer held as MatMulNBits' tensors; traced as one custom op."""

    def __init__(self, m: QuantLinear):
        super().__init__()
        t = nbits_tensors(m)
        self.K, self.N, self.block = m.in_features, m.out_features, t["block"]
        self.register_buffer("b", t["b"])
        self.register_buffer("scales", t["scales"].float())
        self.register_buffer("zero_points", t["zero_points"])
        self.register_buffer("perm", t["perm"])
        self.bias = None if m.bias is None else nn.Parameter(m.bias.detach().float(), requires_grad=False)

    def forward(self, x: Tensor) -> Tensor:
        y = matmul_nbits_op()(x, self.b, self.scales, self.zero_points, self.perm, self.K, self.N, 4, self.block)
        return y if self.bias is None else y + self.bias


def check_embed(qw: QuantizedWeight) -> str | None:
    if gather_block(qw) is None:
        return ("GatherBlockQuantized takes 4- or 8-bit integer codes in power-of-two blocks of at least 16 "
                "(at 4 bits an even number of them a row)")
    return None


def gather_block(qw: QuantizedWeight) -> int | None:
    """GatherBlockQuantized's block for a quantized embedding (a power of two >= 16 inside each group), or None."""
    width = qw.q.shape[-1]
    g = qw.scheme.group(width)
    if qw.scheme.format != "int" or qw.scheme.bits not in (4, 8) or width % g:
        return None
    block = next((b for b in BLOCKS if g % b == 0), None)
    if block is None or (qw.scheme.bits == 4 and (width // block) % 2):
        return None  # 4-bit zero points pack two blocks a byte: an odd count is left to the dequantized table
    return block


def _gather_reference(ids: Tensor, data: Tensor, scales: Tensor, zero_points: Tensor, bits: int,
                      block_size: int) -> Tensor:
    """GatherBlockQuantized's math in torch (gather_axis 0, quantize_axis 1): gather rows, dequantize them."""
    rows, zp = data[ids.reshape(-1)], zero_points[ids.reshape(-1)]
    if bits == 4:
        rows, zp = unpack_nibbles(rows), unpack_nibbles(zp)
    s = scales[ids.reshape(-1)].float().repeat_interleave(block_size, dim=1)
    w = (rows.float() - zp.float().repeat_interleave(block_size, dim=1)) * s
    return w.reshape(*ids.shape, -1).to(scales.dtype)


def gather_op():
    """Register (once) and return the custom op that stands for GatherBlockQuantized while tracing."""
    global _GATHER
    if _GATHER is None:
        op = torch.library.custom_op("compress_export::gather_block_quantized", mutates_args=())(_gather_reference)
        op.register_fake(lambda ids, data, scales, zero_points, bits, block_size:
                         scales.new_empty(*ids.shape, data.shape[1] * (8 // bits)))
        _GATHER = op
    return _GATHER


def _gather_schema():
    import onnx.defs as d

    P, attr = d.OpSchema.FormalParameter, d.OpSchema.Attribute
    return d.OpSchema(
        "GatherBlockQuantized", "com.microsoft", 1, "ONNX Runtime contrib op (declared here for onnxscript)",
        inputs=[P("data", "T1"), P("indices", "Tind"), P("scales", "T2"), P("zero_points", "T1")],
        outputs=[P("output", "T2")],
        type_constraints=[("T1", ["tensor(uint8)"], ""), ("T2", ["tensor(float)", "tensor(float16)"], ""),
                          ("Tind", ["tensor(int32)", "tensor(int64)"], "")],
        attributes=[attr(a, d.OpSchema.AttrType.INT, "") for a in ("gather_axis", "quantize_axis", "block_size",
                                                                    "bits")])


class GatherQuantizedEmbedding(nn.Module):
    """An embedding held as GatherBlockQuantized's tensors (codes a byte, or two a byte at 4 bits, with scales
    and zero points per block): only the rows asked for are dequantized."""

    def __init__(self, qw: QuantizedWeight, embed_scale: Tensor | None = None):
        super().__init__()
        self.bits, self.block = qw.scheme.bits, gather_block(qw)
        self.register_buffer("embed_scale", embed_scale)  # Gemma's scaled embedding multiplies inside the module
        width = qw.q.shape[-1]
        groups = torch.arange(0, width, self.block) // qw.scheme.group(width)  # the group of each block
        z = zeros_of_weight(qw)[:, groups]  # [vocab, blocks]
        pack = pack_nibbles if self.bits == 4 else (lambda t: t.to(torch.uint8))
        self.register_buffer("data", pack(qw.q))  # [vocab, width (/ 2)]
        self.register_buffer("zero_points", pack(z))
        self.register_buffer("scales", qw.scale[:, groups].float())

    def forward(self, ids: Tensor) -> Tensor:
        rows = gather_op()(ids, self.data, self.scales, self.zero_points, self.bits, self.block)
        return rows if self.embed_scale is None else rows * self.embed_scale.to(rows.dtype)


def zeros_of_weight(qw: QuantizedWeight) -> Tensor:
    return qw.zero.to(torch.uint8) if qw.zero is not None else torch.full(qw.scale.shape, qw.scheme.sym_zero,
                                                                        dtype=torch.uint8)


def nbits_copy(model: nn.Module, dtype: torch.dtype, tables: Tables | None = None) -> nn.Module:
    """A copy of ``model`` in ``dtype`` whose QuantLinear layers are NBitsLinear; a quantized embedding becomes
    GatherBlockQuantized (its tied head, at 4 bits, MatMulNBits on the same codes) where its blocks fit."""
    model = copy.deepcopy(model)
    for name, m in [(n, m) for n, m in model.named_modules() if isinstance(m, QuantLinear)]:
        set_module(model, name, NBitsLinear(m))
    embed = tables.embed if tables is not None else None
    if embed is not None and gather_block(embed.weight) is None:
        log.info("%s: its %s codes do not fit GatherBlockQuantized's blocks; written dequantized, as asked",
                 embed.name, embed.weight.scheme)
    elif embed is not None:
        scale = getattr(model.get_submodule(embed.name), "embed_scale", None)
        set_module(model, embed.name, GatherQuantizedEmbedding(embed.weight, scale))
        head = tables.head
        if head is not None and head.tied and check(lin := QuantLinear.from_quantized(head.weight)) is None:
            set_module(model, head.name, NBitsLinear(lin))
    return model.to(dtype).eval()


def write(source: Source, folder: Path, dtype: torch.dtype) -> None:
    def prepare(model: nn.Module, dtype: torch.dtype) -> nn.Module:
        return nbits_copy(model, dtype, source.tables)

    write_onnx(source, folder, dtype, "onnx-int4", prepare, translations())
