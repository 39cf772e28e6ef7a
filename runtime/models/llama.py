"""The runtime's decoder for the Llama family (llama, mistral, qwen2, qwen3, gemma) and its
mixture-of-experts relatives (mixtral, qwen2_moe, qwen3_moe, olmoe).

The families differ only in data (compress/families.py, keyed by ``config.model_type``): Qwen3 normalizes q and k
per head before RoPE, OLMoE over the whole q and k projections (and may clip q/k/v to ``clip_qkv``),
Gemma scales embeddings by sqrt(hidden) and stores RMSNorm weights as ``w - 1``; MoE families replace
the MLP of their sparse layers by runtime/models/moe.py's ``SparseMoE``, configured by ``Family.moe``.
Biases follow the checkpoint (Qwen2's q/k/v biases are simply present there). The forward takes
token ids, positions and the attention metadata explicitly: ``model(input_ids, positions, meta)``
returns final hidden states ``[T, hidden]``; ``compute_logits`` runs the LM head on the rows that
need it. Linears are attributes the loader fills (fused ``qkv_proj`` and ``gate_up_proj``; each
an ``nn.Linear``, a quantized module, or a ``ConcatLinear``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from compress.families import FAMILIES, Family, require
from runtime.kernels.attention import AttentionMetadata, paged_attention
from runtime.kernels.fused import TORCH_OPS, Ops
from runtime.models.layers import ACTIVATIONS, RMSNorm, Rotary
from runtime.models.moe import MoEConfig, SparseMoE


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a decoder, read from a transformers ``config.json`` dict."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    act: str
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None  # "sliding_attention" / "full_attention" per layer (Qwen2, Qwen3)
    clip_qkv: float | None = None  # OLMoE: q, k, v clamped to [-clip_qkv, clip_qkv]
    moe: MoEConfig | None = None

    @property
    def arch(self) -> Family:
        return FAMILIES[self.model_type]

    def window(self, layer: int) -> int | None:
        """Layer ``layer``'s sliding window: every layer's when the config names no layer_types (Mistral)."""
        sliding = self.layer_types is None or self.layer_types[layer] == "sliding_attention"
        return self.sliding_window if sliding else None

    @classmethod
    def from_hf(cls, cfg: dict) -> "ModelConfig":
        model_type = cfg.get("model_type")
        require(model_type, "runtime")
        heads = cfg["num_attention_heads"]
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        theta = rope.pop("rope_theta", None) or cfg.get("rope_theta") or 10000.0
        act = cfg.get("hidden_activation") or cfg.get("hidden_act") or FAMILIES[model_type].default_act
        if act not in ACTIVATIONS:
            raise ValueError(f"activation {act!r} is not supported; supported: {sorted(ACTIVATIONS)}")
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
        moe = FAMILIES[model_type].moe
        return cls(
            model_type=model_type, vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"], num_layers=cfg["num_hidden_layers"], num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6), rope_theta=float(theta),
            rope_scaling=rope if rope.get("rope_type", rope.get("type", "default")) != "default" else None,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", model_type == "gemma"),
            act=act, sliding_window=window, clip_qkv=cfg.get("clip_qkv"),
            layer_types=tuple(cfg["layer_types"]) if cfg.get("layer_types") else None,
            moe=MoEConfig.from_hf(moe, cfg, cfg["num_hidden_layers"]) if moe else None,
        )


# (q, k, v, k_cache, v_cache, meta, scale, window, k_scale, v_scale) -> out (runtime/kernels/attention.py)
AttentionFn = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, AttentionMetadata, float, int | None, Tensor | None,
                        Tensor | None], Tensor]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, window: int | None = None):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.scale = cfg.head_dim ** -0.5
        self.window = window  # sliding window (runtime/kernels/attention.py), None: full causal attention
        self.qkv_proj: nn.Module = nn.Identity()  # [T, hidden] -> [T, (Hq + 2 Hkv) * D], set by the loader
        self.o_proj: nn.Module = nn.Identity()
        norm, d = cfg.arch.qk_norm, cfg.head_dim
        self.norm_proj, self.clip = norm == "proj", cfg.clip_qkv
        q_dim, k_dim = (cfg.num_heads * d, cfg.num_kv_heads * d) if self.norm_proj else (d, d)
        self.q_norm = RMSNorm(q_dim, cfg.rms_norm_eps, dtype=dtype) if norm else None
        self.k_norm = RMSNorm(k_dim, cfg.rms_norm_eps, dtype=dtype) if norm else None
        self.k_cache: Tensor | None = None  # [num_blocks, block_size, Hkv, D], set by the runner
        self.v_cache: Tensor | None = None
        self.k_scale: Tensor | None = None  # [num_blocks, block_size, Hkv] fp16 for an 8-bit cache, else None
        self.v_scale: Tensor | None = None
        self.attn_fn: AttentionFn = paged_attention
        self.ops: Ops = TORCH_OPS

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, meta: AttentionMetadata) -> Tensor:
        t, hq, hkv, rope = x.shape[0], self.num_heads, self.num_kv_heads, self.ops.rope
        qkv = self.qkv_proj(x)
        if self.norm_proj:  # OLMoE: normalize the whole q and k projections, then clip
            q, k, v = qkv.split([hq * self.head_dim, hkv * self.head_dim, hkv * self.head_dim], dim=-1)
            qkv = torch.cat([self.q_norm(q), self.k_norm(k), v], dim=-1)
        if self.clip is not None:
            qkv = qkv.clamp(-self.clip, self.clip)
        qkv = qkv.view(t, hq + 2 * hkv, self.head_dim)
        v = qkv[:, hq + hkv:]
        if self.q_norm is None or self.norm_proj:
            qk = rope(qkv, cos, sin, hq + hkv)  # q and k heads rotated together
            q, k = qk[:, :hq], qk[:, hq:hq + hkv]
        else:
            q = rope(self.q_norm(qkv[:, :hq]), cos, sin, hq)[:, :hq]
            k = rope(self.k_norm(qkv[:, hq:hq + hkv]), cos, sin, hkv)[:, :hkv]
        o = self.attn_fn(q, k, v, self.k_cache, self.v_cache, meta, self.scale, self.window, self.k_scale,
                         self.v_scale)
        return self.o_proj(o.reshape(t, hq * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up_proj: nn.Module = nn.Identity()  # [T, hidden] -> [T, 2 * intermediate]
        self.down_proj: nn.Module = nn.Identity()
        self.act_name = cfg.act
        self.ops: Ops = TORCH_OPS

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(self.ops.act_mul(self.gate_up_proj(x), self.act_name))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, index: int):
        super().__init__()
        off = cfg.arch.norm_offset
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, off, dtype)
        self.self_attn = Attention(cfg, dtype, cfg.window(index))
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, off, dtype)
        moe = cfg.moe
        if moe is not None and index in moe.sparse_layers:
            shared = MLP(cfg) if moe.shared_intermediate_size else None
            self.mlp: nn.Module = SparseMoE(moe, cfg.hidden_size, ACTIVATIONS[cfg.act][0], shared)
        else:
            self.mlp = MLP(cfg)

    def forward(self, h: Tensor, residual: Tensor, cos: Tensor, sin: Tensor, meta: AttentionMetadata,
                next_norm: RMSNorm) -> Tensor:
        """``h``: this layer's normalized input; ``residual`` (the stream) gains attention and MLP in place.
        Returns ``next_norm`` of the stream: the next layer's input (the final norm after the last layer)."""
        h = self.post_attention_layernorm.add_forward(residual, self.self_attn(h, cos, sin, meta))
        return next_norm.add_forward(residual, self.mlp(h))


class DecoderLM(nn.Module):
    """Token ids + positions + attention metadata -> hidden states; ``compute_logits`` for the LM head."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, max_positions: int):
        super().__init__()
        self.config, self.dtype = cfg, dtype
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(DecoderLayer(cfg, dtype, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.arch.norm_offset, dtype)
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, max_positions)
        self.lm_head: nn.Module | None = None  # None: tied to embed_tokens
        # each layer ends with the next one's input norm (fused with the residual add), the last with the final norm
        self.next_norms = [layer.input_layernorm for layer in self.layers[1:]] + [self.norm]
        self.embed_scale = cfg.hidden_size ** 0.5 if cfg.arch.embed_scale else None

    def forward(self, input_ids: Tensor, positions: Tensor, meta: AttentionMetadata) -> Tensor:
        x = self.embed_tokens(input_ids)
        if self.embed_scale is not None:
            x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        cos, sin = self.rotary(positions, x.dtype)
        h = self.layers[0].input_layernorm(x)
        for layer, norm in zip(self.layers, self.next_norms):  # x: the residual stream, updated in place
            h = layer(h, x, cos, sin, meta, norm)
        return h

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """fp32 logits ``[N, vocab]`` for hidden rows ``[N, hidden]``."""
        if self.lm_head is None:
            return F.linear(hidden, self.embed_tokens.weight).float()
        return self.lm_head(hidden).float()

    def set_ops(self, ops: Ops) -> None:
        """Run the small per-layer ops with ``ops`` (runtime/kernels/fused.py)."""
        for module in self.modules():
            if hasattr(module, "ops"):
                module.ops = ops

    def attention_modules(self) -> list[Attention]:
        return [layer.self_attn for layer in self.layers]

    def moe_modules(self) -> list[SparseMoE]:
        return [layer.mlp for layer in self.layers if isinstance(layer.mlp, SparseMoE)]
