"""Rotations folded into the weights (QuaRot, Ashkboos et al., 2024; SpinQuant): the model computes the same
function, but its weights and activations have their outlier channels spread over all channels, which is what
round-to-nearest grids quantize well.

1. Every RMSNorm's weight is folded into the linears that read it (Gemma's ``offset + w`` form included), so
   each norm is a pure ``x / rms(x)``, which commutes with any orthogonal ``Q`` (``rms(x Q) = rms(x)``).
2. The residual stream is rotated, ``x -> x Q``: embeddings ``E Q``, every weight reading the stream ``W Q``,
   every weight writing it ``Q^T W`` (and its bias ``b Q``), the output head ``W diag(w_final) Q``.
3. Each attention head's values are rotated by a Hadamard ``H`` of the head size, folded into v_proj's rows
   and o_proj's columns (attention mixes tokens, never channels, so ``H`` passes through it).

The result is a plain model of its family (every export and the runtime load it unchanged). Which weights
read and write the stream is data (``Residual`` in compress/format/mappings.py). An online Hadamard on down_proj's
input is deliberately not offered: it does not fold, so the runtime, the ONNX graph and llama.cpp would all
need an extra op, and the model would no longer be a plain model of its family.

Tied embeddings stay tied when the final norm's weight is uniform (then it commutes with ``Q`` and stays in
the norm); otherwise no single matrix can be both ``E Q`` (the embedding) and ``E diag(w) Q`` (the head), so
the head is untied, as QuaRot's and llm-compressor's transforms do, and the report says what it costs.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from compress.format.families import FAMILIES, BlockMap, Residual, require
from compress.methods.common.report import RotateNote
from compress.transforms.hadamard import random_hadamard

log = logging.getLogger(__name__)
ROTATIONS = ("none", "hadamard")


@dataclass(frozen=True)
class Rotation:
    """The orthogonal matrices of one rotation (float64): the residual's ``q`` and the per-head ``h``."""

    q: Tensor  # [hidden, hidden]
    h: Tensor  # [head_dim, head_dim]
    head_dim: int
    norm_offset: float = 0.0  # Gemma's norms multiply by (offset + weight)


# ---- pure tensor functions -------------------------------------------------------------------------------

def fold_norm(reader: Tensor, norm_weight: Tensor, offset: float = 0.0) -> Tensor:
    """``reader: [..., in]`` reading a norm's output, with the norm's ``offset + w`` folded into its columns."""
    return reader * (offset + norm_weight.to(reader.dtype))


def rotate_reader(w: Tensor, q: Tensor) -> Tensor:
    """A weight ``[..., hidden]`` that reads the stream ``x -> x Q``: ``W Q``."""
    return w @ q.to(w.dtype)


def rotate_writer(w: Tensor, q: Tensor) -> Tensor:
    """A weight ``[..., hidden, in]`` that writes the stream: ``Q^T W``."""
    return q.T.to(w.dtype) @ w


def rotate_head_rows(w: Tensor, h: Tensor, head_dim: int) -> Tensor:
    """Rows of ``w: [heads * head_dim, ...]`` (v_proj's weight or bias) rotated per head: ``H^T W_h``."""
    wh = w.reshape(-1, head_dim, *w.shape[1:])  # [heads, head_dim, ...]
    return torch.einsum("dk,hd...->hk...", h.to(w.dtype), wh).reshape(w.shape)


def rotate_head_columns(w: Tensor, h: Tensor, head_dim: int) -> Tensor:
    """Columns of ``w: [out, heads * head_dim]`` (o_proj) rotated per head: ``W_h H``."""
    return (w.reshape(w.shape[0], -1, head_dim) @ h.to(w.dtype)).reshape(w.shape)


# ---- applying them to a model ----------------------------------------------------------------------------

def _param(module: nn.Module, name: str) -> nn.Parameter:
    owner, _, leaf = name.rpartition(".")
    return getattr(module.get_submodule(owner) if owner else module, leaf)


def _set(p: Tensor, value: Tensor) -> None:
    p.data.copy_(value.to(p.dtype))


def residual_map(model: nn.Module) -> tuple[BlockMap, Residual]:
    """The family's residual map, after checking the rotation can be folded into ``model``: before any work."""
    from compress.calibrate import decoder_layers

    mt = model.config.model_type
    bmap = FAMILIES[mt].smooth if mt in FAMILIES else None
    why = bmap.no_rotation if bmap is not None else "compress/format/families.py has no map of its residual stream"
    res = require(mt, "rotate", f"{why}; use rotate: none").smooth.residual
    block = decoder_layers(model)[0]
    names = [n for norm, readers in res.reads for n in (norm, *readers)] + [*res.writes, *res.values]
    missing = [n for n in names if not _has(block, n)]
    missing += [n for n in (FAMILIES[mt].final_norm,) if not _has(model, n + ".weight")]
    if missing:
        raise ValueError(f"rotate: model_type {mt!r}: expected weights {missing} are missing, so the rotation "
                         "cannot be folded; the map in compress/format/families.py does not fit this model")
    biased = [norm for norm, _ in res.reads if _has(block, norm.removesuffix("weight") + "bias")]
    if biased:
        raise ValueError(f"rotate: model_type {mt!r}: norms {biased} have a bias (LayerNorm, not RMSNorm); "
                         "a rotation does not commute with mean subtraction: use rotate: none")
    return bmap, res


def _has(module: nn.Module, name: str) -> bool:
    try:
        return isinstance(_param(module, name), Tensor)
    except AttributeError:
        return False


def make_rotation(model: nn.Module, kind: str, seed: int, norm_offset: float = 0.0) -> Rotation:
    """The seeded randomized Hadamards for ``model``'s hidden size and head size."""
    if kind not in ROTATIONS or kind == "none":
        raise ValueError(f"rotate={kind!r}: use one of {ROTATIONS}")
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return Rotation(random_hadamard(cfg.hidden_size, seed), random_hadamard(head_dim, seed + 1), head_dim,
                    norm_offset)


@torch.no_grad()
def rotate_block(block: nn.Module, res: Residual, rot: Rotation) -> None:
    """Fold the block's norms and rotate its residual reads and writes by ``rot.q``, its values per head by
    ``rot.h``; one block at a time, so a streaming pass can rotate each block as it loads it."""
    for norm_name, readers in res.reads:
        norm = _param(block, norm_name)
        for r in readers:
            p = _param(block, r)
            _set(p, rotate_reader(fold_norm(p.data.double(), norm.data.double(), rot.norm_offset), rot.q))
        norm.data.fill_(1.0 - rot.norm_offset)
    for w in res.writes:
        p = _param(block, w)
        _set(p, rotate_writer(p.data.double(), rot.q))
        bias = w.removesuffix("weight") + "bias"
        if w.endswith(".weight") and _has(block, bias):
            b = _param(block, bias)
            _set(b, b.data.double() @ rot.q)
    v_name, o_name = res.values
    v, o = _param(block, v_name), _param(block, o_name)
    _set(v, rotate_head_rows(v.data.double(), rot.h, rot.head_dim))
    v_bias = v_name.removesuffix("weight") + "bias"
    if _has(block, v_bias):
        b = _param(block, v_bias)
        _set(b, rotate_head_rows(b.data.double(), rot.h, rot.head_dim))
    _set(o, rotate_head_columns(o.data.double(), rot.h, rot.head_dim))


@torch.no_grad()
def rotate_embeddings(model: nn.Module, rot: Rotation) -> None:
    """The input embedding's rows ``E Q``: every token enters the stream rotated."""
    emb = model.get_input_embeddings().weight
    _set(emb, emb.data.double() @ rot.q)


@torch.no_grad()
def rotate_head(model: nn.Module, res: Residual, rot: Rotation) -> bool:
    """Fold the final norm into the output head and rotate it (``W diag(w) Q``); returns True when a tied head
    had to be untied (the final norm's weight is not uniform). Call before :func:`rotate_embeddings`."""
    head, emb = model.get_output_embeddings(), model.get_input_embeddings()
    norm = _param(model, FAMILIES[model.config.model_type].final_norm + ".weight")
    tied = head.weight is emb.weight
    scale = rot.norm_offset + norm.data.double()
    if tied and torch.all(scale == scale[0]):  # a uniform norm weight commutes with Q: the tie survives
        return False
    new = rotate_reader(fold_norm(head.weight.data.double(), norm.data.double(), rot.norm_offset), rot.q)
    if tied:
        head.weight = nn.Parameter(new.to(head.weight.dtype), requires_grad=head.weight.requires_grad)
        model.config.tie_word_embeddings = False
    else:
        _set(head.weight, new)
    norm.data.fill_(1.0 - rot.norm_offset)
    return tied


def rotate_model(model: nn.Module, kind: str = "hadamard", seed: int = 0) -> RotateNote:
    """Rotate ``model`` in place (checks first, then embeddings, every block, the head); its fp outputs are
    unchanged up to float rounding."""
    from compress.calibrate import decoder_layers

    bmap, res = residual_map(model)
    rot = make_rotation(model, kind, seed, bmap.norm_offset)
    untied = rotate_head(model, res, rot)
    rotate_embeddings(model, rot)
    for block in decoder_layers(model):
        rotate_block(block, res, rot)
    added = model.get_output_embeddings().weight.numel() * model.get_output_embeddings().weight.element_size()
    report = RotateNote(kind, rot.q.shape[0], rot.head_dim, untied, added if untied else 0)
    if untied:
        log.warning("rotate: the final norm's weight is not uniform, so the tied output head was untied "
                    "(+%.1f MiB of fp parameters)", report.added_bytes / 2**20)
    return report
