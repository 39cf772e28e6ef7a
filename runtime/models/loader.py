"""Checkpoints in: plain HF folders (safetensors), quantized folders written by ``compress quantize``,
and GGUF files (dequantized once by ``compress.models`` and cached as safetensors).

Quantized linears are rebuilt as ``compress.qlinear.QuantLinear`` straight from their integers
(``config.json`` ``quantization_config.modules`` names each one); nothing is dequantized here. q/k/v
and gate/up are fused into one linear each when their formats allow (plain weights, or identical
quantization schemes without act-order), by concatenating output rows; otherwise they run side by side.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor, nn

from compress.qlinear import QuantLinear
from runtime.models.layers import ConcatLinear
from runtime.models.llama import DecoderLM, ModelConfig

log = logging.getLogger(__name__)


@dataclass
class Checkpoint:
    """A model's config, tensors and tokenizer, wherever they came from."""

    name: str
    config: dict
    tensors: dict[str, Tensor]
    quant_modules: dict[str, dict] = field(default_factory=dict)
    tokenizer: object | None = None
    eos_token_ids: tuple[int, ...] = ()


def _eos_ids(*sources) -> tuple[int, ...]:
    ids: list[int] = []
    for src in sources:
        if src is None:
            continue
        for i in (src if isinstance(src, (list, tuple)) else [src]):
            if isinstance(i, int) and i not in ids:
                ids.append(i)
    return tuple(ids)


def _read_safetensors(path: Path) -> dict[str, Tensor]:
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} holds no *.safetensors weights; the runtime reads safetensors only")
    tensors: dict[str, Tensor] = {}
    for f in files:
        tensors.update(load_file(str(f)))
    return tensors


def open_checkpoint(spec: str) -> Checkpoint:
    """Resolve ``spec`` with ``compress.models.resolve`` and read config, tensors and tokenizer."""
    from compress.models import _load_gguf, load_tokenizer, resolve

    src = resolve(spec)
    try:
        tokenizer = load_tokenizer(src)
    except (OSError, ValueError, TypeError) as e:
        log.warning("no tokenizer for %s (%s); only token-id prompts will work", spec, str(e).splitlines()[0])
        tokenizer = None
    tok_eos = getattr(tokenizer, "eos_token_id", None)
    if src.gguf_file:
        hf = _load_gguf(src, torch.float32)
        gen = getattr(hf, "generation_config", None)
        cfg = hf.config.to_dict()
        return Checkpoint(src.name, cfg, dict(hf.state_dict()), {}, tokenizer,
                          _eos_ids(getattr(gen, "eos_token_id", None), cfg.get("eos_token_id"), tok_eos))
    cfg = json.loads((src.path / "config.json").read_text())
    quant: dict[str, dict] = {}
    if src.quantized:
        from compress.checkpoint import read_quantization_config

        quant = read_quantization_config(src.path)["modules"]
    gen_file = src.path / "generation_config.json"
    gen_eos = json.loads(gen_file.read_text()).get("eos_token_id") if gen_file.is_file() else None
    return Checkpoint(src.name, cfg, _read_safetensors(src.path), quant, tokenizer,
                      _eos_ids(gen_eos, cfg.get("eos_token_id"), tok_eos))


def _linear(ckpt: Checkpoint, name: str, in_f: int, out_f: int, dtype: torch.dtype) -> nn.Module:
    """One linear of the checkpoint: a QuantLinear from its integers, or an nn.Linear."""
    t = ckpt.tensors
    bias = t.get(f"{name}.bias")
    if name in ckpt.quant_modules:
        from compress.checkpoint import scheme_of

        entry = ckpt.quant_modules[name]
        m = QuantLinear(in_f, out_f, scheme_of(entry), bias=bias is not None, act_order=entry.get("act_order", False),
                        dtype=dtype)
        state = {k: t[f"{name}.{k}"] for k in ("qweight", "scales", "qzeros", "g_idx", "bias") if f"{name}.{k}" in t}
        m.load_state_dict(state, strict=True)
        return m
    w = t.get(f"{name}.weight")
    if w is None:
        raise ValueError(f"checkpoint {ckpt.name} has no tensor {name}.weight (nor a quantized {name})")
    if tuple(w.shape) != (out_f, in_f):
        raise ValueError(f"{name}.weight has shape {tuple(w.shape)}, the config implies {(out_f, in_f)}")
    lin = nn.Linear(in_f, out_f, bias=bias is not None, dtype=dtype)
    lin.weight.data.copy_(w)
    if bias is not None:
        lin.bias.data.copy_(bias)
    return lin.requires_grad_(False)


def _fusable_quant(parts: list[nn.Module]) -> bool:
    first = parts[0]
    return all(isinstance(p, QuantLinear) and p.scheme == first.scheme and p.in_features == first.in_features
               and p.g_idx is None and (p.bias is None) == (first.bias is None) for p in parts)


def fuse(parts: list[nn.Module]) -> nn.Module:
    """One linear computing ``cat([p(x) for p in parts], -1)``, by stacking output rows when possible."""
    if len(parts) == 1:
        return parts[0]
    if all(type(p) is nn.Linear for p in parts) and len({p.bias is None for p in parts}) == 1:
        out = nn.Linear(parts[0].in_features, sum(p.out_features for p in parts), bias=parts[0].bias is not None,
                        dtype=parts[0].weight.dtype)
        out.weight.data.copy_(torch.cat([p.weight for p in parts]))
        if out.bias is not None:
            out.bias.data.copy_(torch.cat([p.bias for p in parts]))
        return out.requires_grad_(False)
    if _fusable_quant(parts):
        first = parts[0]
        out = QuantLinear(first.in_features, sum(p.out_features for p in parts), first.scheme,
                          bias=first.bias is not None, dtype=first.compute_dtype)
        out.qweight.copy_(torch.cat([p.qweight for p in parts]))
        out.scales.copy_(torch.cat([p.scales for p in parts]))
        if out.qzeros is not None:
            out.qzeros.copy_(torch.cat([p.qzeros for p in parts]))
        if out.bias is not None:
            out.bias.data.copy_(torch.cat([p.bias for p in parts]))
        return out
    return ConcatLinear(parts)


def _copy(param: Tensor, t: Tensor, name: str) -> None:
    if param.shape != t.shape:
        raise ValueError(f"{name} has shape {tuple(t.shape)}, the config implies {tuple(param.shape)}")
    param.data.copy_(t)


def build_model(ckpt: Checkpoint, dtype: torch.dtype, max_positions: int) -> DecoderLM:
    """The runtime's model with the checkpoint's weights (quantized linears stay QuantLinear)."""
    cfg = ModelConfig.from_hf(ckpt.config)
    model = DecoderLM(cfg, dtype, max_positions)
    t = ckpt.tensors
    h, d, hq, hkv, inter = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size
    _copy(model.embed_tokens.weight, t["model.embed_tokens.weight"], "model.embed_tokens.weight")
    _copy(model.norm.weight, t["model.norm.weight"], "model.norm.weight")
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        att = layer.self_attn
        att.qkv_proj = fuse([_linear(ckpt, p + "self_attn.q_proj", h, hq * d, dtype),
                             _linear(ckpt, p + "self_attn.k_proj", h, hkv * d, dtype),
                             _linear(ckpt, p + "self_attn.v_proj", h, hkv * d, dtype)])
        att.o_proj = _linear(ckpt, p + "self_attn.o_proj", hq * d, h, dtype)
        if att.q_norm is not None:
            _copy(att.q_norm.weight, t[p + "self_attn.q_norm.weight"], p + "self_attn.q_norm.weight")
            _copy(att.k_norm.weight, t[p + "self_attn.k_norm.weight"], p + "self_attn.k_norm.weight")
        layer.mlp.gate_up_proj = fuse([_linear(ckpt, p + "mlp.gate_proj", h, inter, dtype),
                                       _linear(ckpt, p + "mlp.up_proj", h, inter, dtype)])
        layer.mlp.down_proj = _linear(ckpt, p + "mlp.down_proj", inter, h, dtype)
        _copy(layer.input_layernorm.weight, t[p + "input_layernorm.weight"], p + "input_layernorm.weight")
        _copy(layer.post_attention_layernorm.weight, t[p + "post_attention_layernorm.weight"],
              p + "post_attention_layernorm.weight")
    if "lm_head" in ckpt.quant_modules or not cfg.tie_word_embeddings:
        model.lm_head = _linear(ckpt, "lm_head", h, cfg.vocab_size, dtype)
    return model.eval().requires_grad_(False)
