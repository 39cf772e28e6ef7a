"""Which kernels run where: Triton on CUDA tensors, the torch reference everywhere else.

Nothing here imports Triton unless a CUDA device asks for it, so CPU-only installs never need it.
``COMPRESS_DISABLE_TRITON=1`` forces the torch path (for A/B checks on a GPU).
"""
from __future__ import annotations

import functools
import importlib.util
import os

import torch


@functools.lru_cache(maxsize=None)
def _triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


def use_triton(device: torch.device | str) -> bool:
    """True when the Triton kernels should run for tensors on ``device``."""
    device = torch.device(device)
    return device.type == "cuda" and _triton_importable() and os.environ.get("COMPRESS_DISABLE_TRITON") != "1"


def attention_fn(device: torch.device | str):
    """The ``paged_attention``-compatible function for ``device`` (what ``Attention.attn_fn`` holds)."""
    if use_triton(device):
        from runtime.kernels.triton_attention import triton_paged_attention

        return triton_paged_attention
    from runtime.kernels.attention import paged_attention

    return paged_attention


def triton_linear(ql):
    """The Triton module for one ``QuantLinear`` (call only where ``use_triton`` holds): it reads the
    packed int32 codes directly, so the weight is never dequantized in memory."""
    from runtime.kernels.triton_qmatmul import TritonQuantLinear

    return TritonQuantLinear(ql)
