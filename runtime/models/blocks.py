"""The decoder block of the native runtime models: attention, the gated MLP (or a sparse MoE), and the norms
around them in the family's form.

A block reads its normalized input ``h`` and adds its two branches to the residual stream in place. Each add is
fused with the norm that reads the sum (``add_norm``: one pass in the fused CPU kernels), so the block ends with
the *next* block's input norm, and the model's first norm runs before the first block. Where the norms sit is
``Family.norms`` (compress/format/families.py), mapped here to checkpoint names by role:

- ``"pre"`` (Llama): ``input_layernorm`` before attention, ``post_attention_layernorm`` before the MLP.
- ``"sandwich"`` (Gemma 2/3): those two plus ``post_attention_layernorm`` on the attention output and
  ``post_feedforward_layernorm`` on the MLP output, before each is added (the pre-MLP norm is then
  ``pre_feedforward_layernorm``).
- ``"post"`` (OLMo 2): only the output norms; attention and the MLP read the stream as it is.

Granite's ``residual_multiplier`` scales both branch outputs before the add.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor, nn

from runtime.kernels.attention import AttentionMetadata, paged_attention
from runtime.kernels.fused import TORCH_OPS, Ops
from runtime.models.layers import ACTIVATIONS, RMSNorm, add_norm, apply_rope
from runtime.models.model_config import ModelConfig
from runtime.models.moe import SparseMoE

# Family.norms -> checkpoint names of a block's norms by role: (attention in, attention out, MLP in, MLP out)
NORM_ROLES: dict[str, tuple[str | None, str | None, str | None, str | None]] = {
    "pre": ("input_layernorm", None, "post_attention_layernorm", None),
    "sandwich": ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                 "post_feedforward_layernorm"),
    "post": (None, "post_attention_layernorm", None, "post_feedforward_layernorm"),
}

# (q, k, v, k_cache, v_cache, meta, scale, window, k_scale, v_scale, softcap=None) -> out
# (runtime/kernels/attention.py)
AttentionFn = Callable[..., Tensor]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, window: int | None = None):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.scale, self.softcap = cfg.attn_scale, cfg.attn_softcap
        self.window = window  # sliding window (runtime/kernels/attention.py), None: full causal attention
        self.qkv_proj: nn.Module = nn.Identity()  # [T, hidden] -> [T, (Hq + 2 Hkv) * D], set by the loader
        self.o_proj: nn.Module = nn.Identity()
        norm, d, off = cfg.arch.qk_norm, cfg.head_dim, cfg.arch.norm_offset
        self.norm_proj, self.clip = norm == "proj", cfg.clip_qkv
        q_dim, k_dim = (cfg.num_heads * d, cfg.num_kv_heads * d) if self.norm_proj else (d, d)
        self.q_norm = RMSNorm(q_dim, cfg.rms_norm_eps, off, dtype) if norm else None
        self.k_norm = RMSNorm(k_dim, cfg.rms_norm_eps, off, dtype) if norm else None
        self.k_cache: Tensor | None = None  # [num_blocks, block_size, Hkv, D], set by the runner
        self.v_cache: Tensor | None = None
        self.k_scale: Tensor | None = None  # [num_blocks, block_size, Hkv] fp16 for an 8-bit cache, else None
        self.v_scale: Tensor | None = None
        self.attn_fn: AttentionFn = paged_attention
        self.ops: Ops = TORCH_OPS

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, meta: AttentionMetadata) -> Tensor:
        t, hq, hkv, ops = x.shape[0], self.num_heads, self.num_kv_heads, self.ops
        qkv = self.qkv_proj(x)
        if self.norm_proj:  # OLMoE, OLMo 2: normalize the whole q and k projections (then OLMoE clips)
            q, k, v = qkv.split([hq * self.head_dim, hkv * self.head_dim, hkv * self.head_dim], dim=-1)
            qkv = torch.cat([self.q_norm(q), self.k_norm(k), v], dim=-1)
        if self.clip is not None:
            qkv = qkv.clamp(-self.clip, self.clip)
        qkv = qkv.view(t, hq + 2 * hkv, self.head_dim)
        v = qkv[:, hq + hkv:]
        if self.q_norm is None or self.norm_proj:
            qk = apply_rope(ops, qkv, cos, sin, hq + hkv)  # q and k heads rotated together
            q, k = qk[:, :hq], qk[:, hq:hq + hkv]
        else:  # per-head norms (Qwen3, Gemma 3) before RoPE
            q = apply_rope(ops, self.q_norm(qkv[:, :hq]), cos, sin, hq)
            k = apply_rope(ops, self.k_norm(qkv[:, hq:hq + hkv]), cos, sin, hkv)
        o = self.attn_fn(q, k, v, self.k_cache, self.v_cache, meta, self.scale, self.window, self.k_scale,
                         self.v_scale, softcap=self.softcap)
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
        roles = NORM_ROLES[cfg.arch.norms]
        self.norm_names = tuple(n for n in roles if n)  # attributes named as in the checkpoint
        for name in self.norm_names:
            setattr(self, name, RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.arch.norm_offset, dtype))
        # by role, None where the form has no norm (a plain tuple: the modules are registered above)
        self.norms = tuple(getattr(self, n) if n else None for n in roles)
        self.self_attn = Attention(cfg, dtype, cfg.window(index))
        moe = cfg.moe
        if moe is not None and index in moe.sparse_layers:
            shared = MLP(cfg) if moe.shared_intermediate_size else None
            self.mlp: nn.Module = SparseMoE(moe, cfg.hidden_size, ACTIVATIONS[cfg.act][0], shared)
        else:
            self.mlp = MLP(cfg)
        self.residual_multiplier = cfg.residual_multiplier

    @property
    def input_norm(self) -> RMSNorm | None:
        """The norm before attention (None: attention reads the stream itself)."""
        return self.norms[0]

    def _branch(self, out: Tensor, norm: RMSNorm | None) -> Tensor:
        """What a branch adds to the stream: its output, normalized (sandwich and post norms), scaled (Granite)."""
        if norm is not None:
            out = norm(out)
        if self.residual_multiplier is not None:
            out = out * self.residual_multiplier
        return out

    def forward(self, h: Tensor, residual: Tensor, cos: Tensor, sin: Tensor, meta: AttentionMetadata,
                next_norm: RMSNorm | None) -> Tensor:
        """``h``: this layer's input (normalized, or the stream itself); ``residual`` (the stream) gains attention
        and MLP in place. Returns ``next_norm`` of the stream: the next layer's input (the final norm after the
        last layer)."""
        _, attn_out, mlp_in, mlp_out = self.norms
        h = add_norm(residual, self._branch(self.self_attn(h, cos, sin, meta), attn_out), mlp_in)
        return add_norm(residual, self._branch(self.mlp(h), mlp_out), next_norm)
