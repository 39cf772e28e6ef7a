"""The LM head on CPU: an fp head rounded to int8/int4 at load, and a tied quantized head that shares its codes
with the embedding.

A tied quantized head (``quantization_config.head.tied``) is a QuantLinear over the embedding's buffers. Its w8a8
tiles (runtime/kernels/w8a8.py ``pack_tiles``) take exactly the bytes of the packed codes for each 16 rows, so
:func:`prepare_tied_head` rewrites the embedding's ``qweight`` into tiles in place, a slab of rows at a time, and the
embedding becomes a ``w8a8.TiledEmbedding`` that gathers its rows from those tiles: the [vocab, hidden] codes are
held once, and no full-size temporary is made (a second copy was 136 MiB of the 0.5B shape's 317 MiB).
"""
from __future__ import annotations

import sys

import torch
from torch import Tensor, nn

from compress.format.qlinear import QuantEmbedding, QuantLinear
from compress.format.quant import Scheme, quantize_weight
from runtime.config import LM_HEADS
from runtime.kernels import w8a8
from runtime.kernels.fp_gemv import GemvLinear
from runtime.kernels.qmatmul import MkldnnLinear, groups_foldable, mkldnn_bf16_available, prepare_linear

SLAB_ROWS = 1024  # rows of the table converted to tiles per step (a multiple of 16; a few MiB of temporaries)


def tiles_in_place(qweight: Tensor, bits: int, cols: int) -> Tensor:
    """``qweight`` (int32 codes packed along ``cols``, rows a multiple of 16) rewritten as w8a8 tiles in its own
    storage, ``SLAB_ROWS`` rows at a time; returns the uint8 [rows / 16, cols * 2 * bits] view of it."""
    from compress.format.quant import unpack

    rows = qweight.shape[0]
    assert rows % 16 == 0 and cols % w8a8.BLOCK == 0 and qweight.is_contiguous()
    raw = qweight.view(torch.uint8).view(rows, -1)  # [rows, cols * bits / 8]: each 16 rows' bytes hold their tile
    for s in range(0, rows, SLAB_ROWS):
        codes = unpack(qweight[s:s + SLAB_ROWS], bits, cols)  # a copy: the slab's bytes are free to overwrite
        raw[s:s + codes.shape[0]] = w8a8.pack_tiles(codes, bits).view(codes.shape[0], -1)
    return raw.view(rows // 16, -1)


def tiles_shareable(head: QuantLinear, embed: nn.Module, fused: bool, lean: bool) -> bool:
    """Whether the w8a8 kernel can run ``head`` from the tied embedding's own bytes, rewritten in place."""
    return (getattr(head, "tied", False) and isinstance(embed, QuantEmbedding) and embed.qweight is head.qweight
            and fused and w8a8.available() and w8a8.fits(head) and head.g_idx is None and groups_foldable(head)
            and not (lean and head.scheme.bits < 8) and head.out_features % 16 == 0
            and head.scheme.group(head.in_features) * head.scheme.n_groups(head.in_features) == head.in_features
            and sys.byteorder == "little")


def prepare_tied_head(model: nn.Module, head: QuantLinear, mode: str, dtype: torch.dtype, fused: bool,
                      lean: bool) -> nn.Module:
    """The kernel for the model's quantized ``lm_head``; a tied one shares its tiles with the embedding."""
    embed = model._modules.get("embed_tokens")  # the native model's own attribute (not a backend's property)
    if mode not in ("auto", "packed") or not tiles_shareable(head, embed, fused, lean):
        return prepare_linear(head, mode, dtype, fused, lean)
    tiles = tiles_in_place(head.qweight, head.scheme.bits, head.in_features)
    kernel = prepare_linear(head, mode, dtype, fused, lean, tiles=tiles)
    assert isinstance(kernel, w8a8.W8A8Linear), kernel
    model.embed_tokens = w8a8.TiledEmbedding(kernel, embed)
    return kernel


# The LM head rounded to nearest at load (the checkpoint keeps its fp weight): per-channel int8 is what
# llama.cpp stores for SmolLM2's tied head (Q8_0); int4 g32 halves the bytes again at a measured accuracy cost.
LM_HEAD_SCHEMES = {"int8": Scheme(bits=8, group_size=-1, sym=True), "int4": Scheme(bits=4, group_size=32, sym=False)}


def resolve_lm_head(choice: str, quantized_model: bool, dtype: torch.dtype, device_type: str) -> str:
    """``"auto"``: int8 for a quantized model computed in bf16 on CPU (its packed kernels' setting), else fp."""
    if choice not in LM_HEADS:
        raise ValueError(f"lm_head={choice!r} is unknown; use one of {LM_HEADS}")
    if choice != "auto":
        return choice
    return "int8" if quantized_model and dtype == torch.bfloat16 and device_type == "cpu" else "fp"


def round_rows(weight: Tensor, scheme: Scheme, rows: int = 4096) -> QuantLinear:
    """RTN of a large fp ``weight [out, in]`` a slab of output rows at a time (its schemes are row-local), so
    a 128k-vocabulary head never has an fp32 copy or full-size temporaries."""
    out_f, in_f = weight.shape
    ql = QuantLinear(in_f, out_f, scheme)
    for s in range(0, out_f, rows):
        part = QuantLinear.from_quantized(quantize_weight(weight[s:s + rows].detach().float(), scheme))
        ql.qweight[s:s + rows], ql.scales[s:s + rows] = part.qweight, part.scales
        if ql.qzeros is not None:
            ql.qzeros[s:s + rows] = part.qzeros
    return ql


def prepare_lm_head(weight: Tensor, choice: str, dtype: torch.dtype, fused: bool = False,
                    lean: bool = False, mode: str = "auto") -> nn.Module | None:
    """The head module for an fp ``weight [vocab, hidden]``: quantized, prepacked bf16, or None (keep F.linear).
    A quantized one runs from its codes only, unless ``mode`` is "hybrid" (a bf16 copy of the [vocab, hidden]
    table for calls of many rows)."""
    if choice in LM_HEAD_SCHEMES:
        return prepare_linear(round_rows(weight, LM_HEAD_SCHEMES[choice]),
                              "hybrid" if mode == "hybrid" and not lean else "packed", dtype, fused, lean)
    if dtype == torch.bfloat16 and mkldnn_bf16_available():
        return MkldnnLinear(weight, None)
    if dtype == torch.float32 and fused:
        return GemvLinear(weight, None)
    return None
