"""Small building blocks of the decoder: RMSNorm, rotary embeddings, activations, fused linears."""
from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from runtime.kernels.fused import ACTIVATIONS, TORCH_OPS, Ops

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


class ConcatLinear(nn.Module):
    """Several linears on the same input with outputs concatenated (when their weights cannot be fused)."""

    def __init__(self, parts: list[nn.Module]):
        super().__init__()
        self.parts = nn.ModuleList(parts)

    def forward(self, x: Tensor) -> Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)
