"""What llama.cpp calls each model family and its tensors: model knowledge as data, keyed by model_type.

Rotary layout (llama.cpp ``llama_model_rope_type``): the ``llama`` architecture runs NORM rope, which
rotates pairs of adjacent head dimensions ``(2i, 2i+1)``; Hugging Face's Llama rotates ``(i, i + d/2)``,
so llama.cpp's converter interleaves the rows of each q/k head (``permute_qk``). ``qwen2``, ``qwen2moe``,
``qwen3``, ``qwen3moe`` and ``gemma`` run NEOX rope, which is Hugging Face's layout already. Permuting
rows of a quantized tensor is exact: GGUF blocks run along the input dimension, within one row.

Rotary scaling: a linear one is two keys; llama3 (Llama 3.1/3.2) and longrope (Phi-3.5, Phi-4-mini) are F32 tensors
of one factor per rotary frequency, each frequency divided by its factor, as llama.cpp's converter writes them:
``rope_freqs`` (computed from the config), and ``rope_factors_long`` / ``rope_factors_short`` (the config's lists)
with ``rope.scaling.attn_factor`` and ``rope.scaling.original_context_length``.
"""
from __future__ import annotations

import math
import re

import torch
from torch import Tensor

from compress.format.families import GGUFArch, require


# Hugging Face module name -> GGUF tensor name ("weight"/"bias" is appended); blocks are "blk.{i}".
TOP_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
BLOCK_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",  # the MoE router
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
    "mlp.experts.down_proj": "ffn_down_exps",  # [E, H, I]
}
# Fused tensors llama.cpp keeps apart: rows split in order (transformers' gate_up_proj [E, 2I, H]).
SPLIT_NAMES = {"mlp.experts.gate_up_proj": ("ffn_gate_exps", "ffn_up_exps")}
ROUTERS = ("ffn_gate_inp", "ffn_gate_inp_shexp")  # kept in F32, as llama.cpp keeps them
VECTORS = ("ffn_gate_inp_shexp",)  # HF [1, H], llama.cpp {n_embd}
_BLOCK = re.compile(r"^model\.layers\.(\d+)\.(.+)$")

# (GGUF key under the architecture, config attributes tried in order): written when the config has one.
UINT_HPARAMS = (
    ("context_length", ("max_position_embeddings",)),
    ("embedding_length", ("hidden_size",)),
    ("block_count", ("num_hidden_layers",)),
    ("feed_forward_length", ("intermediate_size",)),
    ("attention.head_count", ("num_attention_heads",)),
    ("attention.head_count_kv", ("num_key_value_heads",)),
    ("expert_count", ("num_local_experts", "num_experts")),
    ("expert_used_count", ("num_experts_per_tok",)),
    ("expert_feed_forward_length", ("moe_intermediate_size",)),
    ("expert_shared_feed_forward_length", ("shared_expert_intermediate_size",)),
)


def arch_of(model_type: str) -> GGUFArch:
    return require(model_type, "gguf").gguf


def gguf_names(module: str, arch: GGUFArch | None = None) -> tuple[str, ...]:
    """The GGUF tensor name(s), without "weight"/"bias", of a Hugging Face module or fused parameter (``arch``'s
    own names first: a post-norm is ``post_attention_norm`` in Gemma 2, the pre-MLP norm ``ffn_norm`` in Llama)."""
    if module in TOP_NAMES:
        return (TOP_NAMES[module],)
    m = _BLOCK.match(module)
    if m is not None:
        i, rest = m.groups()
        names = {**BLOCK_NAMES, **dict(arch.names if arch is not None else ())}
        if rest in names:
            return (f"blk.{i}.{names[rest]}",)
        if rest in SPLIT_NAMES:
            return tuple(f"blk.{i}.{n}" for n in SPLIT_NAMES[rest])
    raise ValueError(f"no GGUF tensor name for {module!r}: compress/exporters/gguf_arch.py maps "
                     f"{', '.join(TOP_NAMES)} and model.layers.N.{{{', '.join(BLOCK_NAMES)}}}")


def head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


# llama.cpp architectures that read each rotary scaling's per-frequency tensors (llama-model.cpp's loaders):
# llama3 rope through ``rope_freqs`` (the llama and granite loaders), longrope through ``rope_factors_long/short``
ROPE_TENSOR_ARCHS = {"llama3": ("llama", "granite"), "longrope": ("phi3",)}


def rope_parameters(config) -> tuple[dict, dict | None]:
    """The full-attention layers' rope parameters, and the sliding layers' where they have their own (Gemma 3)."""
    params = getattr(config, "rope_parameters", None) or {}
    if "full_attention" in params:  # one rope per layer type
        return params["full_attention"], params.get("sliding_attention")
    return params, None


def rotary_dim(config) -> int:
    """How many dimensions of each head rotate (Phi-4-mini's partial rotary turns 3/4 of them)."""
    rope = getattr(config, "rope_parameters", None) or {}
    partial = getattr(config, "partial_rotary_factor", None) or rope.get("partial_rotary_factor") or 1.0
    return int(head_dim(config) * partial)


def _theta(config, params: dict) -> float:
    return float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))


def _original_context(config, params: dict) -> int:
    value = params.get("original_max_position_embeddings", getattr(config, "original_max_position_embeddings", None))
    if value is None:
        raise ValueError(f"rope_type {params.get('rope_type')!r} needs original_max_position_embeddings in the config")
    return int(value)


def llama3_rope_freqs(params: dict, theta: float, dim: int) -> Tensor:
    """Llama 3.1's rotary scaling as llama.cpp's ``rope_freqs``: what each of the ``dim/2`` frequencies is divided by.
    Wavelengths shorter than ``original / high_freq_factor`` keep their frequency (1), those longer than
    ``original / low_freq_factor`` are slowed by ``factor``, and the band between blends the two frequencies."""
    factor, low, high = float(params["factor"]), float(params["low_freq_factor"]), float(params["high_freq_factor"])
    original = float(params["original_max_position_embeddings"])
    if high <= low:
        raise ValueError(f"llama3 rope needs high_freq_factor > low_freq_factor, got {high} and {low}")
    freq = theta ** -(torch.arange(0, dim, 2, dtype=torch.float64) / dim)  # [dim/2]
    wavelen = 2 * math.pi / freq
    smooth = (original / wavelen - low) / (high - low)  # 0 at the low-frequency edge, 1 at the high one
    blended = 1 / ((1 - smooth) / factor + smooth)  # freq / blended == (1 - smooth) * freq / factor + smooth * freq
    out = torch.where(wavelen < original / high, torch.ones_like(freq), blended)
    return torch.where(wavelen > original / low, torch.full_like(freq, factor), out).float()


def longrope_attn_factor(config, params: dict) -> float:
    """LongRoPE's cos/sin scale: the config's ``attention_factor``, else sqrt(1 + ln s / ln original) where s is
    ``factor`` or max / original positions (transformers' rule; llama.cpp's converter takes the positions ratio)."""
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    original = _original_context(config, params)
    scale = params.get("factor") or config.max_position_embeddings / original
    return 1.0 if scale <= 1 else math.sqrt(1 + math.log(scale) / math.log(original))


def rope_metadata(config, arch: GGUFArch | None = None) -> dict[str, float | str | int]:
    """The rotary keys: a plain or linearly scaled rope, llama3 and longrope (whose per-frequency factors are tensors,
    :func:`rope_tensors`), and (Gemma 3) the sliding layers' own base."""
    params, local = rope_parameters(config)
    kind = params.get("rope_type", "default")
    if kind not in ("default", "linear", *ROPE_TENSOR_ARCHS):
        raise ValueError(f"--format gguf writes plain, linear, llama3 or longrope rotary embeddings; this model uses "
                         f"rope_type {kind!r}")
    if kind in ROPE_TENSOR_ARCHS and arch is not None and arch.name not in ROPE_TENSOR_ARCHS[kind]:
        raise ValueError(f"llama.cpp's {arch.name!r} architecture does not read {kind} rope factors (only "
                         f"{', '.join(ROPE_TENSOR_ARCHS[kind])} do)")
    out: dict[str, float | str | int] = {"rope.freq_base": _theta(config, params)}
    if kind == "linear":
        out.update({"rope.scaling.type": "linear", "rope.scaling.factor": float(params["factor"])})
    if kind == "longrope":  # llama.cpp picks the long factors when the context exceeds the original one
        out.update({"rope.scaling.attn_factor": longrope_attn_factor(config, params),
                    "rope.scaling.original_context_length": _original_context(config, params)})
    if local is not None:
        if local.get("rope_type", "default") != "default":
            raise ValueError("--format gguf writes plain rotary embeddings on sliding layers")
        out["rope.freq_base_swa"] = float(local["rope_theta"])
    return out


def rope_tensors(config) -> dict[str, Tensor]:
    """The F32 per-frequency rotary factors llama.cpp reads, by GGUF name (none for a plain or linear rope)."""
    params, _ = rope_parameters(config)
    kind, half = params.get("rope_type", "default"), rotary_dim(config) // 2
    if kind == "llama3":
        return {"rope_freqs.weight": llama3_rope_freqs(params, _theta(config, params), rotary_dim(config))}
    if kind != "longrope":
        return {}
    out = {}
    for which in ("long", "short"):
        factors = params.get(f"{which}_factor")
        if factors is None or len(factors) != half:
            raise ValueError(f"longrope's {which}_factor must list {half} factors (half the rotary width), got "
                             f"{None if factors is None else len(factors)}")
        out[f"rope_factors_{which}.weight"] = torch.tensor(factors, dtype=torch.float32)
    return out


def hparams(config, arch: GGUFArch) -> dict[str, int | float | str | list[bool]]:
    """The ``{arch}.*`` metadata llama.cpp reads to build the graph."""
    out: dict[str, int | float | str | list[bool]] = {}
    for key, attrs in UINT_HPARAMS:
        value = next((getattr(config, a) for a in attrs if getattr(config, a, None) is not None), None)
        if value is not None:
            out[f"{arch.name}.{key}"] = int(value)
    d = head_dim(config)
    out[f"{arch.name}.attention.key_length"] = out[f"{arch.name}.attention.value_length"] = d
    out[f"{arch.name}.rope.dimension_count"] = rotary_dim(config)
    out.update({f"{arch.name}.{k}": v for k, v in rope_metadata(config, arch).items()})
    out[f"{arch.name}.attention.layer_norm_rms_epsilon"] = float(config.rms_norm_eps)
    out[f"{arch.name}.vocab_size"] = int(config.vocab_size)
    for key, attr in arch.scalars:  # e.g. Granite's multipliers
        out[f"{arch.name}.{key}"] = float(getattr(config, attr))
    for key, attr in arch.counts:
        out[f"{arch.name}.{key}"] = int(getattr(config, attr))
    if arch.swa_layers:  # which layers attend within the sliding window
        out[f"{arch.name}.attention.sliding_window_pattern"] = [t == "sliding_attention" for t in config.layer_types]
    return out


def rope_rows(t: Tensor, n_head: int) -> Tensor:
    """Rows of a q/k projection (weight, bias, or packed blocks) from HF's half-split rotary layout to
    llama.cpp's interleaved one: within each head, row ``2i + j`` takes row ``j * d/2 + i``."""
    rows = t.shape[0]
    assert rows % (2 * n_head) == 0, f"{rows} rows do not split into {n_head} heads of even width"
    # [rows, ...] -> [n_head, 2, d/2, ...] -> [n_head, d/2, 2, ...] -> [rows, ...]
    return t.reshape(n_head, 2, rows // n_head // 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)


def rope_heads(gguf_name: str, config, arch: GGUFArch) -> int | None:
    """How many heads to interleave for this tensor (``None``: leave its rows alone)."""
    if not arch.permute_qk:
        return None
    if gguf_name.endswith(".attn_q"):
        return config.num_attention_heads
    if gguf_name.endswith(".attn_k"):
        return config.num_key_value_heads
    return None
