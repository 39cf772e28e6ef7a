"""Model knowledge as data: which op feeds which linears inside a decoder block, per model_type.

AWQ folds a per-input-channel scale ``s`` into the op before a group of linears (a norm's weight, or
the rows of a preceding linear) and multiplies the linears' columns by ``s``. Names are relative to
one decoder block. ``inspect`` names the submodule whose output measures the error of a scale
(``None``: the concatenated outputs of the linears themselves).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Smooth:
    prev: str  # a norm or a linear inside the block
    linears: tuple[str, ...]
    inspect: str | None = None


@dataclass(frozen=True)
class Residual:
    """How a block reads and writes the residual stream, for rotations (compress/rotate.py). Names are
    parameters: ``reads`` pairs each norm with the weights that read its output (last dim = hidden),
    ``writes`` are the weights that add to the stream (dim -2 = hidden; a sibling ``bias`` is rotated too),
    ``values`` the value/output projections rotated per head."""

    reads: tuple[tuple[str, tuple[str, ...]], ...]
    writes: tuple[str, ...]
    values: tuple[str, str] = ("self_attn.v_proj.weight", "self_attn.o_proj.weight")
    final_norm: str = "model.norm"  # relative to the model, read by the output head


@dataclass(frozen=True)
class BlockMap:
    smooths: tuple[Smooth, ...]
    norm_offset: float = 0.0  # Gemma's RMSNorm multiplies by (offset + weight)
    # AWQ's clipping search skips q/k: their error is read through a softmax, not their own output
    no_clip: tuple[str, ...] = ("self_attn.q_proj", "self_attn.k_proj")
    residual: Residual | None = None  # None: a residual rotation cannot be folded; ``no_rotation`` says why
    no_rotation: str = ""


# Linears that always stay in full precision: the output head and MoE routers.
KEEP_FP = (r"(^|\.)lm_head$", r"\.gate$", r"shared_expert_gate$", r"\.router$")


_ATTN_IN = Smooth("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "self_attn")
_ATTN_OUT = Smooth("self_attn.v_proj", ("self_attn.o_proj",))
_MLP_UP = ("mlp.gate_proj", "mlp.up_proj")
_MLP_DOWN = Smooth("mlp.up_proj", ("mlp.down_proj",))

_QKV = ("input_layernorm.weight", ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"))
_DENSE_RES = Residual((_QKV, ("post_attention_layernorm.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight"))),
                      ("self_attn.o_proj.weight", "mlp.down_proj.weight"))
_MOE_RES = Residual((_QKV, ("post_attention_layernorm.weight", ("mlp.gate.weight", "mlp.experts.gate_up_proj"))),
                    ("self_attn.o_proj.weight", "mlp.experts.down_proj"))
_SHARED = ("mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.up_proj.weight", "mlp.shared_expert_gate.weight")
_QWEN2_MOE_RES = Residual((_QKV, ("post_attention_layernorm.weight", (*_MOE_RES.reads[1][1], *_SHARED))),
                          (*_MOE_RES.writes, "mlp.shared_expert.down_proj.weight"))

_LLAMA = BlockMap((_ATTN_IN, _ATTN_OUT, Smooth("post_attention_layernorm", _MLP_UP, "mlp"), _MLP_DOWN),
                  residual=_DENSE_RES)
_GEMMA = BlockMap(_LLAMA.smooths, norm_offset=1.0, residual=_DENSE_RES)
_GEMMA2 = BlockMap((_ATTN_IN, _ATTN_OUT, Smooth("pre_feedforward_layernorm", _MLP_UP, "mlp"), _MLP_DOWN),
                   norm_offset=1.0, no_rotation="its post-attention and post-feedforward norms normalize what the "
                   "block writes to the residual stream, so their weights cannot be folded into any linear")
# Mixture-of-experts blocks: only attention is smoothed here; experts are handled by compress/moe.py
_MOE = BlockMap((_ATTN_IN, _ATTN_OUT), residual=_MOE_RES)

BLOCK_MAPS: dict[str, BlockMap] = {
    "llama": _LLAMA,
    "mistral": _LLAMA,
    "qwen2": _LLAMA,
    "qwen3": _LLAMA,
    "gemma": _GEMMA,
    "gemma2": _GEMMA2,
    "gemma3_text": _GEMMA2,
    "mixtral": _MOE,
    "qwen2_moe": BlockMap(_MOE.smooths, residual=_QWEN2_MOE_RES),
    "qwen3_moe": _MOE,
    "olmoe": _MOE,
}


def block_map(model_type: str) -> BlockMap:
    if model_type not in BLOCK_MAPS:
        raise ValueError(f"model_type {model_type!r} has no mapping in compress/mappings.py; "
                         f"supported: {', '.join(sorted(BLOCK_MAPS))} (rtn, gptq and nf4 need none)")
    return BLOCK_MAPS[model_type]
