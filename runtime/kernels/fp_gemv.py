"""fp32 linears of the decode step on CPU (runtime/kernels/cpu/fp_gemv.cpp): a few rows times an fp32 weight.

MKL's sgemm behind ``F.linear`` reads an fp32 weight at ~11 GB/s for one row on the AMD EPYC's 2 cores,
where the cores stream 32 GB/s; ``fp32_gemv`` reads ~27 GB/s. An fp32 model's decode step is nothing but
reading its weights (538 MB a token for SmolLM2), so this is most of its speed. Calls of more rows (prompts,
large batches) keep ``F.linear``, whose blocked GEMM wins there. The sums run in another order than MKL's:
results equal ``F.linear``'s to fp32 rounding (~1e-7 relative), not bit for bit.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

MAX_ROWS = 4  # past this many rows per call, F.linear's GEMM


class GemvLinear(nn.Module):
    """An fp32 ``nn.Linear`` whose calls of at most ``MAX_ROWS`` rows run ``compress_cpu::fp32_gemv``."""

    path = "fp32-gemv"

    def __init__(self, weight: Tensor, bias: Tensor | None):
        super().__init__()
        self.weight = nn.Parameter(weight.detach().float().contiguous(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(), requires_grad=False)
        self.in_features, self.out_features = self.weight.shape[1], self.weight.shape[0]
        self._args = (self.weight, self.bias)  # plain attribute: no nn.Module lookups per call
        self._op = torch.ops.compress_cpu.fp32_gemv.default

    def forward(self, x: Tensor) -> Tensor:
        rows = x.numel() // self.in_features
        if rows > MAX_ROWS or x.dtype != torch.float32:
            return F.linear(x, *self._args)
        y = self._op(x.reshape(rows, self.in_features).contiguous(), *self._args)
        return y.reshape(*x.shape[:-1], self.out_features)
