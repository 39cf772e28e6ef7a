"""Small building blocks of the decoder: RMSNorm, rotary embeddings, activations, fused linears."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

ACTIVATIONS = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
}


class RMSNorm(nn.Module):
    """``x / rms(x) * w`` in fp32; ``offset=1`` is Gemma's ``(1 + w)`` form (weights stored as ``w - 1``)."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)
        self.eps, self.offset = eps, offset

    def forward(self, x: Tensor) -> Tensor:
        # one fused call: bit-identical to transformers' fp32 arithmetic; in bf16 it rounds once
        # (transformers rounds before the weight product too, so this is slightly closer to exact)
        if not self.offset:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight + self.offset, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (self.offset + self.weight.float())).to(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> Tensor:
    """Inverse frequencies for ``rope_type`` default, linear or llama3 (as transformers computes them)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
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
    raise ValueError(f"rope_type={kind!r} is not supported by the runtime; supported: default, linear, llama3")


class Rotary(nn.Module):
    """Precomputed cos/sin per position (half-split layout, as in transformers' rotate_half)."""

    def __init__(self, head_dim: int, theta: float, scaling: dict | None, max_positions: int):
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]  # [P, D/2]
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def forward(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """``cos`` and signed ``sin`` as ``[T, 1, D]`` in ``dtype``: ``[c, c]`` and ``[-s, s]``."""
        cos = self.cos.index_select(0, positions)
        sin = self.sin.index_select(0, positions)
        return torch.cat((cos, cos), -1).to(dtype)[:, None], torch.cat((-sin, sin), -1).to(dtype)[:, None]


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x: [T, H, D]`` (halves as real/imaginary parts, transformers' rotate_half layout).

    ``x * [c, c] + [x2, x1] * [-s, s]`` is bit-for-bit ``x * cos + rotate_half(x) * sin``.
    """
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin


class ConcatLinear(nn.Module):
    """Several linears on the same input with outputs concatenated (when their weights cannot be fused)."""

    def __init__(self, parts: list[nn.Module]):
        super().__init__()
        self.parts = nn.ModuleList(parts)

    def forward(self, x: Tensor) -> Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)
