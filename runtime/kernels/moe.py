"""Routed experts of a mixture-of-experts layer: the weight formats and the kernels that run them.

An experts kernel takes ``x [T, H]``, the router's ``top_k_index``/``top_k_weights [T, k]``, the stacked
``gate_up`` (``[E, 2I, H]``, gate rows then up rows) and ``down`` (``[E, H, I]``) linears and the
activation, and returns ``sum_k weight * down(act(gate) * up)`` per token ``[T, H]``. The stacks are
either fp (:class:`StackedLinears`) or packed integers (compress/format/moe_packed.py's ``PackedLinears``,
the format ``compress quantize`` writes); both answer ``num_experts`` and ``expert_weight(e, dtype)``.

- ``torch_experts`` (CPU): compress's ``packed_moe_forward``: (token, slot) pairs sorted by expert, one
  matmul per active expert over its contiguous run of tokens. Packed experts are dequantized per call,
  only the active ones (``cache_weight`` keeps them dequantized instead, for ``quant_kernel="dequant"``).
- ``triton_experts`` (CUDA): the same sort, then one grouped GEMM launch per projection over every
  active expert at once (runtime/kernels/triton_moe.py), reading packed integers directly.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from compress.format.moe_packed import packed_moe_forward

ExpertsFn = Callable[[Tensor, Tensor, Tensor, nn.Module, nn.Module, Callable[[Tensor], Tensor]], Tensor]


class StackedLinears(nn.Module):
    """``E`` fp linears of one shape as one ``weight [E, out, in]`` (no bias, as in every MoE family here)."""

    def __init__(self, weight: Tensor):
        super().__init__()
        assert weight.dim() == 3, f"stacked expert weights are [E, out, in], got {tuple(weight.shape)}"
        self.register_buffer("weight", weight)
        self.num_experts, self.out_features, self.in_features = weight.shape

    def expert_weight(self, e: int, dtype: torch.dtype = torch.float32) -> Tensor:
        return self.weight[e].to(dtype)

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, in={self.in_features}, out={self.out_features}, dtype={self.weight.dtype}"


def torch_experts(x: Tensor, top_k_index: Tensor, top_k_weights: Tensor, gate_up: nn.Module, down: nn.Module,
                  act: Callable[[Tensor], Tensor]) -> Tensor:
    """CPU path: compress's sorted-token forward, one matmul per active expert (fp or packed stacks)."""
    return packed_moe_forward(x, top_k_index, top_k_weights, gate_up, down, act)


def triton_experts(x: Tensor, top_k_index: Tensor, top_k_weights: Tensor, gate_up: nn.Module, down: nn.Module,
                   act: Callable[[Tensor], Tensor]) -> Tensor:
    """CUDA path: the same contract through the Triton grouped GEMM (runtime/kernels/triton_moe.py)."""
    from runtime.kernels.triton_moe import triton_moe_forward

    return triton_moe_forward(x, top_k_index, top_k_weights, gate_up, down, act)


def prepare_experts(model: nn.Module, mode: str, device_type: str) -> dict[str, int]:
    """Pick each MoE layer's experts kernel (Triton on CUDA); ``mode="dequant"`` on CPU dequantizes packed
    experts once (their exact numbers, at fp memory). Returns how many layers took each path."""
    counts: dict[str, int] = {}
    for moe in model.moe_modules():
        packed = hasattr(moe.gate_up_proj, "qweight")
        if device_type == "cuda":
            moe.experts_fn, path = triton_experts, "experts-triton"
        elif packed and mode == "dequant":
            moe.gate_up_proj.cache_weight()
            moe.down_proj.cache_weight()
            path = "experts-dequant"
        else:
            path = "experts-packed" if packed else "experts-fp"
        counts[path] = counts.get(path, 0) + 1
    return counts
