"""Small building blocks of the decoder: RMSNorm, rotary embeddings, activations, fused linears."""
from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from runtime.kernels.fused import ACTIVATIONS, TORCH_OPS, Ops

ROPE_TYPES = ("default", "linear", "llama3", "longrope")


class RMSNorm(nn.Module):
    """``x / rms(x) * w`` in fp32; ``offset=1`` is Gemma's ``(1 + w)`` form (weights stored as ``w - 1``)."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)
        self.eps, self.offset = eps, offset
        self.ops: Ops = TORCH_OPS  # the runner may swap in the fused kernels (runtime/kernels/fused.py)

    def forward(self, x: Tensor) -> Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps, self.offset)

    def add_forward(self, residual: Tensor, delta: Tensor) -> Tensor:
        """``residual += delta`` in place, then the norm of the sum (one pass in the fused kernels)."""
        return self.ops.add_rms_norm_(residual, delta, self.weight, self.eps, self.offset)


def add_norm(residual: Tensor, delta: Tensor, norm: RMSNorm | None) -> Tensor:
    """``residual += delta`` in place; returns ``norm`` of the sum, or the stream itself when no norm reads it
    (OLMo 2's blocks take the stream as it is)."""
    if norm is None:
        return residual.add_(delta)
    return norm.add_forward(residual, delta)


def rope_kind(params: dict | None) -> str:
    return (params or {}).get("rope_type", (params or {}).get("type", "default"))


def rope_inv_freq(dim: int, theta: float, scaling: dict | None, long: bool = False) -> Tensor:
    """Inverse frequencies of ``dim`` rotated dims for ``rope_type`` default, linear, llama3 or longrope (its
    short factors, or the long ones with ``long``), as transformers computes them."""
    kind = rope_kind(scaling)
    if kind == "longrope":  # Phi-3: each frequency divided by its own factor
        factors = torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float32)
        return 1.0 / (factors * theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"rope_type={kind!r} is not supported by the runtime; supported: {', '.join(ROPE_TYPES)}")


def longrope_attention_factor(params: dict, max_position_embeddings: int) -> float:
    """LongRoPE's cos/sin multiplier: ``attention_factor``, else sqrt(1 + ln(factor) / ln(original length))."""
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    orig = params["original_max_position_embeddings"]
    factor = params.get("factor") or max_position_embeddings / orig
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))


class Rotary(nn.Module):
    """Precomputed cos/sin per position (half-split layout, as in transformers' rotate_half) for the first
    ``head_dim * partial_rotary_factor`` dims of each head.

    ``scaling`` holds the rope parameters besides theta (``rope_type``, factors, ``partial_rotary_factor``).
    LongRoPE (Phi-3) switches from its short to its long factors at ``original_max_position_embeddings``: here
    per position, where transformers switches the whole forward once any position passes that length (the same
    numbers for sequences shorter than it), and multiplies cos/sin by its ``attention_factor``.
    """

    def __init__(self, head_dim: int, theta: float, scaling: dict | None, max_positions: int):
        super().__init__()
        params = scaling or {}
        dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
        pos = torch.arange(max_positions, dtype=torch.float32)[:, None]
        freqs = pos * rope_inv_freq(dim, theta, scaling)[None, :]  # [P, dim/2]
        cos, sin = freqs.cos(), freqs.sin()
        if rope_kind(scaling) == "longrope":
            orig = params["original_max_position_embeddings"]
            far = pos[orig:] * rope_inv_freq(dim, theta, scaling, long=True)[None, :]
            cos[orig:], sin[orig:] = far.cos(), far.sin()
            mscale = params.get("attention_factor", 1.0)
            cos, sin = cos * mscale, sin * mscale
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    @property
    def dim(self) -> int:
        return 2 * self.cos.shape[1]

    def forward(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """``cos`` and signed ``sin`` as ``[T, 1, dim]`` in ``dtype``: ``[c, c]`` and ``[-s, s]``."""
        cos = self.cos.index_select(0, positions)
        sin = self.sin.index_select(0, positions)
        return torch.cat((cos, cos), -1).to(dtype)[:, None], torch.cat((-sin, sin), -1).to(dtype)[:, None]


def apply_rope(ops: Ops, x: Tensor, cos: Tensor, sin: Tensor, heads: int) -> Tensor:
    """The first ``heads`` heads of ``x: [T, H, D]`` rotated in their first ``cos.shape[-1]`` dims (partial
    rotary: Phi-3, ...), the rest passed through; ``[T, heads, D]`` (``x`` may be rotated in place)."""
    rot = cos.shape[-1]
    if rot == x.shape[-1]:
        return ops.rope(x, cos, sin, heads)[:, :heads]
    r = ops.rope(x[:, :, :rot], cos, sin, heads)[:, :heads]
    return torch.cat([r, x[:, :heads, rot:]], dim=-1)


class ConcatLinear(nn.Module):
    """Several linears on the same input with outputs concatenated (when their weights cannot be fused)."""

    def __init__(self, parts: list[nn.Module]):
        super().__init__()
        self.parts = nn.ModuleList(parts)

    def forward(self, x: Tensor) -> Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)
