"""The decoder's small per-layer ops, as two interchangeable sets: the torch reference and the fused CPU kernels.

``TORCH_OPS`` is plain torch (any device; the reference, and bit-for-bit what the runtime computed before the
fused kernels existed). ``FUSED_CPU_OPS`` calls runtime/kernels/cpu/fused_ops.cpp: one kernel per op where
torch runs several (F.rms_norm is five kernels on CPU, rotary four), which is most of a batch-1 decode step on
a small model. Both take and return the same tensors; tests/runtime/test_fused.py holds them to each other.
The runner picks one set per model (``select_ops``) and the modules call ``self.ops.<op>``.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

log = logging.getLogger(__name__)

# activation name (config.hidden_act) -> (torch function, fused kernel id)
ACTIVATIONS: dict[str, tuple[Callable[[Tensor], Tensor], int]] = {
    "silu": (F.silu, 0),
    "swish": (F.silu, 0),
    "gelu_pytorch_tanh": (lambda x: F.gelu(x, approximate="tanh"), 1),
    "gelu_tanh": (lambda x: F.gelu(x, approximate="tanh"), 1),
    "gelu_new": (lambda x: F.gelu(x, approximate="tanh"), 1),
    "gelu": (F.gelu, 2),
}


def _rms_norm(x: Tensor, w: Tensor, eps: float, offset: float) -> Tensor:
    # one fused call: bit-identical to transformers' fp32 arithmetic; in bf16 it rounds once
    # (transformers rounds before the weight product too, so this is slightly closer to exact)
    if not offset:
        return F.rms_norm(x, w.shape, w, eps)
    if x.dtype == torch.float32:
        return F.rms_norm(x, w.shape, w + offset, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * (offset + w.float())).to(x.dtype)


def _add_rms_norm_(residual: Tensor, delta: Tensor, w: Tensor, eps: float, offset: float) -> Tensor:
    return _rms_norm(residual.add_(delta), w, eps, offset)


def _act_mul(gate_up: Tensor, act: str) -> Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return ACTIVATIONS[act][0](gate) * up


def _rope(x: Tensor, cos: Tensor, sin: Tensor, heads: int) -> Tensor:
    """The first ``heads`` heads of ``x: [T, H, D]`` rotated (rotate_half layout; ``cos = [c, c]``,
    ``sin = [-s, s]``): ``x * cos + roll(x, D/2) * sin``, bit-for-bit ``x * cos + rotate_half(x) * sin``."""
    x = x[:, :heads]
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin


def _fused_rms_norm(x: Tensor, w: Tensor, eps: float, offset: float) -> Tensor:
    return torch.ops.compress_cpu.rms_norm(x.contiguous(), w, eps, offset)


def _fused_add_rms_norm_(residual: Tensor, delta: Tensor, w: Tensor, eps: float, offset: float) -> Tensor:
    return torch.ops.compress_cpu.add_rms_norm_(residual, delta.contiguous(), w, eps, offset)


def _fused_act_mul(gate_up: Tensor, act: str) -> Tensor:
    return torch.ops.compress_cpu.act_mul(gate_up.contiguous(), ACTIVATIONS[act][1])


def _fused_rope(x: Tensor, cos: Tensor, sin: Tensor, heads: int) -> Tensor:
    """In place on ``x`` (its first ``heads`` heads); returns ``x``, whose first ``heads`` heads are rotated."""
    torch.ops.compress_cpu.rope_(x, cos.contiguous(), sin.contiguous(), heads)
    return x


@dataclass(frozen=True)
class Ops:
    """One implementation of each small op (see the module docstring)."""

    name: str
    rms_norm: Callable[[Tensor, Tensor, float, float], Tensor]
    add_rms_norm_: Callable[[Tensor, Tensor, Tensor, float, float], Tensor]  # residual += delta; norm(residual)
    act_mul: Callable[[Tensor, str], Tensor]  # [T, 2I] (gate, up) -> act(gate) * up
    rope: Callable[[Tensor, Tensor, Tensor, int], Tensor]  # [T, H, D]: first heads rotated (maybe in place)


TORCH_OPS = Ops("torch", _rms_norm, _add_rms_norm_, _act_mul, _rope)
FUSED_CPU_OPS = Ops("fused-cpu", _fused_rms_norm, _fused_add_rms_norm_, _fused_act_mul, _fused_rope)


def select_ops(device_type: str, dtype: torch.dtype, enabled: bool = True) -> Ops:
    """The fused CPU kernels when they build and load on this machine, else the torch reference."""
    if not enabled or device_type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return TORCH_OPS
    from runtime.kernels import cpu_ext

    return FUSED_CPU_OPS if cpu_ext.load() else TORCH_OPS
