"""What a native runtime model is built from: the decoder's shape and maths, read from its ``config.json``.

The dict goes through transformers' own config class for its ``model_type`` first, so legacy spellings read
as transformers reads them (``rope_scaling`` -> ``rope_parameters``, Gemma 3's ``sliding_window_pattern`` and
``rope_local_base_freq`` -> ``layer_types`` and per-layer-type rope parameters, Phi-3's top-level
``partial_rotary_factor``...) and unset fields take transformers' defaults for the family. How to read the
values (which norm form, which multipliers) is the family's entry in compress/format/families.py.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from compress.format.families import FAMILIES, Family, require
from runtime.models.layers import ACTIVATIONS, ROPE_TYPES, longrope_attention_factor, rope_kind
from runtime.models.moe import MoEConfig

log = logging.getLogger(__name__)

DEFAULT_ROPE = "default"  # the rope key of models with one rotary for every layer


def normalized(cfg: dict) -> dict:
    """``cfg`` as transformers' config class for its model type reads it (defaults filled in, legacy keys
    converted); ``cfg`` itself when transformers does not know the type."""
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig

    try:
        hf = AutoConfig.for_model(**cfg)
    except (ValueError, KeyError, TypeError, StrictDataclassError) as e:
        log.debug("config of model_type %r read as it is (%s)", cfg.get("model_type"), e)
        return cfg
    return {**cfg, **hf.to_dict()}


def _rope(cfg: dict, layer_types: tuple[str, ...] | None) -> dict[str, dict]:
    """rope key -> that rotary's parameters (``rope_type``, ``rope_theta``, factors...): one ``"default"`` entry, or
    one per layer type when the config nests them (Gemma 3: local and global rotaries)."""
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    nested = bool(params) and layer_types is not None and set(params) <= set(layer_types) \
        and all(isinstance(v, dict) for v in params.values())
    groups = {k: dict(v) for k, v in params.items()} if nested else {DEFAULT_ROPE: params}
    for key, p in groups.items():
        p.setdefault("rope_theta", cfg.get("rope_theta") or 10000.0)
        if cfg.get("partial_rotary_factor") is not None:
            p.setdefault("partial_rotary_factor", cfg["partial_rotary_factor"])
        kind = rope_kind(p)
        if kind not in ROPE_TYPES:
            raise ValueError(f"rope_type={kind!r} ({cfg.get('model_type')}) is not supported by the runtime's native "
                             f"models; supported: {', '.join(ROPE_TYPES)} (--model-impl transformers serves others)")
        if kind == "longrope":
            p.setdefault("original_max_position_embeddings", cfg.get("original_max_position_embeddings")
                         or cfg.get("max_position_embeddings", 2048))
            p["attention_factor"] = longrope_attention_factor(p, cfg.get("max_position_embeddings", 2048))
    return groups


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a decoder and the constants of its maths, read from a transformers ``config.json`` dict."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: dict  # rope key (DEFAULT_ROPE, or a layer type) -> {"rope_type", "rope_theta", factors...}
    max_position_embeddings: int
    tie_word_embeddings: bool
    act: str
    attn_scale: float  # the q.k scale: 1/sqrt(head_dim), 1/sqrt(query_pre_attn_scalar) (Gemma 2/3), Granite's own
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None  # "sliding_attention" / "full_attention" per layer
    clip_qkv: float | None = None  # OLMoE: q, k, v clamped to [-clip_qkv, clip_qkv]
    attn_softcap: float | None = None  # Gemma 2: attention scores s -> tanh(s / cap) * cap
    final_softcap: float | None = None  # Gemma 2: logits soft-capped the same way
    embedding_multiplier: float | None = None  # Granite: embeddings times this
    residual_multiplier: float | None = None  # Granite: attention and MLP outputs times this before the residual add
    logits_scaling: float | None = None  # Granite: logits divided by this
    moe: MoEConfig | None = None

    @property
    def arch(self) -> Family:
        return FAMILIES[self.model_type]

    def window(self, layer: int) -> int | None:
        """Layer ``layer``'s sliding window: every layer's when the config names no layer_types (Mistral, Phi-3)."""
        sliding = self.layer_types is None or self.layer_types[layer] == "sliding_attention"
        return self.sliding_window if sliding else None

    def rope_key(self, layer: int) -> str:
        """Which of ``rope`` layer ``layer`` rotates with."""
        return DEFAULT_ROPE if DEFAULT_ROPE in self.rope else self.layer_types[layer]

    @classmethod
    def from_hf(cls, cfg: dict) -> "ModelConfig":
        model_type = cfg.get("model_type")
        arch = require(model_type, "runtime")
        cfg = normalized(cfg)
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        act = cfg.get("hidden_activation") or cfg.get("hidden_act") or arch.default_act
        if act not in ACTIVATIONS:
            raise ValueError(f"activation {act!r} is not supported; supported: {sorted(ACTIVATIONS)}")
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
        layer_types = tuple(cfg["layer_types"]) if cfg.get("layer_types") else None
        scale = cfg["query_pre_attn_scalar"] ** -0.5 if cfg.get("query_pre_attn_scalar") else head_dim ** -0.5
        mult = {k: float(cfg.get(k, 1.0)) for k in ("embedding_multiplier", "residual_multiplier",
                                                     "attention_multiplier", "logits_scaling")} \
            if arch.multipliers else {}
        return cls(
            model_type=model_type, vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"], num_layers=cfg["num_hidden_layers"], num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads, head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6), rope=_rope(cfg, layer_types),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", model_type == "gemma"),
            act=act, attn_scale=mult.get("attention_multiplier", scale), sliding_window=window,
            layer_types=layer_types, clip_qkv=cfg.get("clip_qkv"),
            attn_softcap=cfg.get("attn_logit_softcapping") or None,
            final_softcap=cfg.get("final_logit_softcapping") or None,
            embedding_multiplier=mult.get("embedding_multiplier"), residual_multiplier=mult.get("residual_multiplier"),
            logits_scaling=mult.get("logits_scaling"),
            moe=MoEConfig.from_hf(arch.moe, cfg, cfg["num_hidden_layers"]) if arch.moe else None,
        )
