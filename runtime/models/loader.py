"""Checkpoints in: plain HF folders (safetensors), quantized folders written by ``compress quantize``,
and GGUF files (dequantized once by ``compress.format.models`` and cached as safetensors).

Quantized linears are rebuilt as ``compress.format.qlinear.QuantLinear`` straight from their integers
(``config.json`` ``quantization_config.modules`` names each one); nothing is dequantized here. A quantized
embedding (``quantization_config.embed``) becomes a ``QuantEmbedding`` that dequantizes only the rows a forward
looks up; a tied quantized head (``quantization_config.head.tied``) is a QuantLinear over the embedding's buffers. q/k/v
and gate/up are fused into one linear each when their formats allow (plain weights, or identical
quantization schemes without act-order), by concatenating output rows; otherwise they run side by side.

Mixture-of-experts layers (runtime/models/moe.py) read their experts in any of three layouts: packed
integers (``quantization_config.moe``, compress/format/moe_packed.py's ``PackedLinears``, kept packed), fused
fp ``mlp.experts.gate_up_proj [E, 2I, H]``/``down_proj [E, H, I]`` (transformers 5's modules), or the
per-expert linears hub checkpoints hold (and transformers 5 writes back on save:
``mlp.experts.{e}.gate_proj.weight``..., Mixtral's ``block_sparse_moe.experts.{e}.w1.weight``...),
stacked here once. The router (``mlp.gate.weight``) stays fp32.
"""
from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor, nn

from compress.format.models import ModelSource
from compress.format.moe_packed import PackedLinears
from compress.format.qlinear import QuantEmbedding, QuantLinear
from runtime.models.layers import ConcatLinear
from runtime.models.llama import DecoderLM, ModelConfig
from runtime.kernels.moe import StackedLinears
from compress.format.families import MoEArch
from runtime.models.moe import SparseMoE

log = logging.getLogger(__name__)


@dataclass
class Checkpoint:
    """A model's config, tensors and tokenizer, wherever they came from."""

    name: str
    config: dict
    tensors: Mapping[str, Tensor]
    quant_modules: dict[str, dict] = field(default_factory=dict)
    quant_experts: dict[str, dict] = field(default_factory=dict)  # packed MoE experts (quantization_config.moe)
    quant_embed: dict | None = None  # a quantized input embedding (quantization_config.embed)
    tied_quant_head: bool = False  # the LM head reads the quantized embedding's codes (quantization_config.head)
    tokenizer: object | None = None
    eos_token_ids: tuple[int, ...] = ()
    source: ModelSource | None = None  # where it was read from (the transformers backend loads from there)

    @property
    def quantized(self) -> bool:
        """Whether any linear, expert stack or the embedding is stored as packed integers."""
        return bool(self.quant_modules or self.quant_experts or self.quant_embed)

    @property
    def stored_dtype(self) -> str | None:
        """The dtype the checkpoint's config names (``torch_dtype``, or transformers 5's ``dtype``)."""
        return self.config.get("torch_dtype") or self.config.get("dtype")


def _eos_ids(*sources) -> tuple[int, ...]:
    ids: list[int] = []
    for src in sources:
        if src is None:
            continue
        for i in (src if isinstance(src, (list, tuple)) else [src]):
            if isinstance(i, int) and i not in ids:
                ids.append(i)
    return tuple(ids)


class LazyTensors(Mapping):
    """A folder's safetensors tensors by name, each read from disk when asked for (plain reads, no memory
    map): building the model holds each fp tensor only until it is copied into its module, so startup
    needs about the checkpoint's size, not twice it."""

    def __init__(self, path: Path):
        from compress.format.shards import ShardReader

        try:
            self.reader = ShardReader(path)
        except FileNotFoundError:
            raise FileNotFoundError(f"{path} holds no *.safetensors weights; the runtime reads safetensors only")

    def __getitem__(self, name: str) -> Tensor:
        if name not in self.reader:
            raise KeyError(name)
        return self.reader.get(name)

    def __iter__(self):
        return iter(self.reader.keys())

    def __len__(self) -> int:
        return len(self.reader.entries)


def open_checkpoint(spec: str, trust_remote_code: bool = False) -> Checkpoint:
    """Resolve ``spec`` with ``compress.format.models.resolve`` and read config, tensors and tokenizer (the tokenizer's
    own code runs only with ``trust_remote_code``)."""
    from compress.format.families import check_rope
    from compress.format.models import load_gguf, load_tokenizer, resolve

    src = resolve(spec)
    cfg = None if src.gguf_file else json.loads((src.path / "config.json").read_text())
    if cfg is not None:  # before the tokenizer (whose config load would fail deep inside) and any weight
        check_rope(cfg, src.name)
    try:
        tokenizer = load_tokenizer(src, trust_remote_code)
    except (OSError, ValueError, TypeError) as e:
        log.warning("no tokenizer for %s (%s); only token-id prompts will work", spec, str(e).splitlines()[0])
        tokenizer = None
    tok_eos = getattr(tokenizer, "eos_token_id", None)
    if src.gguf_file:
        hf = load_gguf(src, torch.float32)
        gen = getattr(hf, "generation_config", None)
        cfg = hf.config.to_dict()
        return Checkpoint(src.name, cfg, dict(hf.state_dict()), {}, {}, None, False, tokenizer,
                          _eos_ids(getattr(gen, "eos_token_id", None), cfg.get("eos_token_id"), tok_eos), src)
    qc: dict = {}
    if src.quantized:
        from compress.format.checkpoint import read_quantization_config

        qc = read_quantization_config(src.path)
    gen_file = src.path / "generation_config.json"
    gen_eos = json.loads(gen_file.read_text()).get("eos_token_id") if gen_file.is_file() else None
    return Checkpoint(src.name, cfg, LazyTensors(src.path), qc.get("modules", {}), qc.get("moe", {}),
                      qc.get("embed"), bool((qc.get("head") or {}).get("tied")), tokenizer,
                      _eos_ids(gen_eos, cfg.get("eos_token_id"), tok_eos), src)


def _linear(ckpt: Checkpoint, name: str, in_f: int, out_f: int, dtype: torch.dtype) -> nn.Module:
    """One linear of the checkpoint: a QuantLinear from its integers, or an nn.Linear."""
    t = ckpt.tensors
    bias = t.get(f"{name}.bias")
    if name in ckpt.quant_modules:
        from compress.format.checkpoint import scheme_of

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
    lin = nn.Linear(in_f, out_f, bias=bias is not None, dtype=dtype, device="meta")  # no init to throw away
    lin.weight = nn.Parameter(w.to(dtype), requires_grad=False)
    if bias is not None:
        lin.bias = nn.Parameter(bias.to(dtype), requires_grad=False)
    return lin


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
    """Fill ``param`` with ``t``."""
    if tuple(t.shape) != tuple(param.shape):
        raise ValueError(f"{name} has shape {tuple(t.shape)}, the config implies {tuple(param.shape)}")
    param.data.copy_(t)


def load_mlp(ckpt: Checkpoint, mlp: nn.Module, p: str, hidden: int, inter: int, dtype: torch.dtype) -> None:
    """A gated MLP's linears from ``{p}gate_proj``/``up_proj``/``down_proj`` (gate and up fused when possible)."""
    mlp.gate_up_proj = fuse([_linear(ckpt, p + "gate_proj", hidden, inter, dtype),
                             _linear(ckpt, p + "up_proj", hidden, inter, dtype)])
    mlp.down_proj = _linear(ckpt, p + "down_proj", inter, hidden, dtype)


def _fp_experts(ckpt: Checkpoint, p: str, arch: MoEArch, num_experts: int) -> tuple[Tensor, Tensor]:
    """fp experts of the layer at prefix ``p`` as ``(gate_up [E, 2I, H], down [E, H, I])``, fused or per expert."""
    t = ckpt.tensors
    if p + "mlp.experts.gate_up_proj" in t:
        return t[p + "mlp.experts.gate_up_proj"], t[p + "mlp.experts.down_proj"]
    gate, up, down = arch.legacy_names
    e0 = f"{p}{arch.legacy_block}.experts.{{}}.{{}}.weight"
    if e0.format(0, gate) not in t:
        raise ValueError(f"checkpoint {ckpt.name} has no experts for {p}mlp: neither mlp.experts.gate_up_proj nor "
                         f"{e0.format(0, gate)}")
    experts = range(num_experts)
    return (torch.stack([torch.cat([t[e0.format(e, gate)], t[e0.format(e, up)]]) for e in experts]),
            torch.stack([t[e0.format(e, down)] for e in experts]))


def _packed(ckpt: Checkpoint, name: str, entry: dict, in_f: int, out_f: int) -> PackedLinears:
    """``E`` packed quantized linears ``name`` (``qweight``/``scales``/``qzeros``/``g_idx`` [E, ...]), kept packed."""
    from compress.format.checkpoint import scheme_of

    m = PackedLinears(entry["num_experts"], in_f, out_f, scheme_of(entry), entry.get("act_order", False))
    t = ckpt.tensors
    m.load_state_dict({k: t[f"{name}.{k}"] for k in ("qweight", "scales", "qzeros", "g_idx") if f"{name}.{k}" in t},
                      strict=True)
    return m


def load_moe(ckpt: Checkpoint, moe: SparseMoE, p: str, arch: MoEArch, dtype: torch.dtype) -> None:
    """Router, experts (packed or fp) and shared expert of the MoE layer at prefix ``p``."""
    t, cfg = ckpt.tensors, moe.cfg
    h, n_e, inter = moe.router.shape[1], cfg.num_experts, cfg.intermediate_size
    router = p + "mlp.gate.weight"
    if router not in t:
        router = f"{p}{arch.legacy_block}.gate.weight"
    _copy(moe.router, t[router].float(), router)
    experts = p + "mlp.experts"
    if experts in ckpt.quant_experts:
        entry = ckpt.quant_experts[experts]
        got = (entry["num_experts"], entry["hidden_size"], entry["intermediate_size"])
        if got != (n_e, h, inter):
            raise ValueError(f"quantization_config.moe[{experts!r}] records (experts, hidden, intermediate) = {got}, "
                             f"the model config {(n_e, h, inter)}")
        moe.gate_up_proj = _packed(ckpt, experts + ".gate_up_proj", entry, h, 2 * inter)
        moe.down_proj = _packed(ckpt, experts + ".down_proj", entry, inter, h)
    else:
        gate_up, down = _fp_experts(ckpt, p, arch, n_e)
        for name, w, shape in (("gate_up_proj", gate_up, (n_e, 2 * inter, h)), ("down_proj", down, (n_e, h, inter))):
            if tuple(w.shape) != shape:
                raise ValueError(f"{experts}.{name} has shape {tuple(w.shape)}, the config implies {shape}")
        moe.gate_up_proj, moe.down_proj = StackedLinears(gate_up.to(dtype)), StackedLinears(down.to(dtype))
    if moe.shared_expert is not None:
        load_mlp(ckpt, moe.shared_expert, p + "mlp.shared_expert.", h, cfg.shared_intermediate_size, dtype)
        moe.shared_expert_gate = _linear(ckpt, p + "mlp.shared_expert_gate", h, 1, dtype)


def build_model(ckpt: Checkpoint, dtype: torch.dtype, max_positions: int) -> DecoderLM:
    """The runtime's model with the checkpoint's weights (quantized linears stay QuantLinear)."""
    cfg = ModelConfig.from_hf(ckpt.config)
    model = DecoderLM(cfg, dtype, max_positions)
    t = ckpt.tensors
    h, d, hq, hkv, inter = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size
    load_embedding(ckpt, model, cfg, dtype)
    _copy(model.norm.weight, t["model.norm.weight"], "model.norm.weight")
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        att = layer.self_attn
        if cfg.arch.fused_proj:  # stored fused (Phi-3): taken as it is, quantized or not
            att.qkv_proj = _linear(ckpt, p + "self_attn.qkv_proj", h, (hq + 2 * hkv) * d, dtype)
        else:
            att.qkv_proj = fuse([_linear(ckpt, p + "self_attn.q_proj", h, hq * d, dtype),
                                 _linear(ckpt, p + "self_attn.k_proj", h, hkv * d, dtype),
                                 _linear(ckpt, p + "self_attn.v_proj", h, hkv * d, dtype)])
        att.o_proj = _linear(ckpt, p + "self_attn.o_proj", hq * d, h, dtype)
        if att.q_norm is not None:
            _copy(att.q_norm.weight, t[p + "self_attn.q_norm.weight"], p + "self_attn.q_norm.weight")
            _copy(att.k_norm.weight, t[p + "self_attn.k_norm.weight"], p + "self_attn.k_norm.weight")
        if isinstance(layer.mlp, SparseMoE):
            load_moe(ckpt, layer.mlp, p, cfg.arch.moe, dtype)
        elif cfg.arch.fused_proj:
            layer.mlp.gate_up_proj = _linear(ckpt, p + "mlp.gate_up_proj", h, 2 * inter, dtype)
            layer.mlp.down_proj = _linear(ckpt, p + "mlp.down_proj", inter, h, dtype)
        else:
            load_mlp(ckpt, layer.mlp, p + "mlp.", h, inter, dtype)
        for name in layer.norm_names:  # the family's norms (runtime/models/blocks.py NORM_ROLES)
            _copy(getattr(layer, name).weight, t[p + name + ".weight"], p + name + ".weight")
    if ckpt.tied_quant_head:  # one tensor set: the head reads the embedding's codes
        model.lm_head = model.embed_tokens.as_linear()
    elif "lm_head" in ckpt.quant_modules or not cfg.tie_word_embeddings:
        model.lm_head = _linear(ckpt, "lm_head", h, cfg.vocab_size, dtype)
    return model.eval().requires_grad_(False)


def load_embedding(ckpt: Checkpoint, model: DecoderLM, cfg: ModelConfig, dtype: torch.dtype) -> None:
    """The input embedding: a :class:`QuantEmbedding` from its codes (lookups dequantize only their rows), or the
    fp table."""
    name, shape = "model.embed_tokens", (cfg.vocab_size, cfg.hidden_size)
    if ckpt.quant_embed is not None:
        from compress.format.checkpoint import scheme_of

        q = QuantEmbedding(*shape, scheme_of(ckpt.quant_embed), dtype, device="meta")  # the family scales it itself
        q.load_state_dict({k: ckpt.tensors[f"{name}.{k}"] for k in q.state_dict()}, strict=True, assign=True)
        if tuple(q.qweight.shape[:1]) != shape[:1]:
            raise ValueError(f"{name}.qweight has {q.qweight.shape[0]} rows, the config implies {shape[0]}")
        model.embed_tokens = q
        return
    t = ckpt.tensors[f"{name}.weight"]
    if tuple(t.shape) != shape:
        raise ValueError(f"{name}.weight has shape {tuple(t.shape)}, the config implies {shape}")
    model.embed_tokens.weight = nn.Parameter(t.to(dtype), requires_grad=False)  # replaces the meta placeholder
