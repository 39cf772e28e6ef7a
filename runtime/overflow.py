"""Serving in float16 without silent inf/NaN: a probe forward at load, and a finite check on every fp16 forward.

float16 tops out at 65504. A model whose residual stream grows past that (Gemma's does, at its first token)
produces inf, then NaN once a norm divides inf by inf, and sampling from NaN logits yields garbage text with no
error. An inf anywhere in the stream reaches the logits of its own position through the norms and of every later
position through the keys and values, so the logits are a complete place to look: checking them costs one
``isfinite`` over logits already copied to the host, and runs only when the compute dtype is float16.
At load a short probe forward (the BOS token, then ids spread over the vocabulary: massive activations sit on the
first tokens) turns the common case into an error before anything is served.
"""
from __future__ import annotations

import torch
from torch import Tensor

FIX = "serve it with --dtype bfloat16 (the same memory, with float32's range) or --dtype float32"
PROBE_TOKENS = 16


class Float16Overflow(ValueError):
    """The model's activations leave float16's range."""


def check_finite(logits: Tensor, dtype: torch.dtype) -> None:
    """Raise :class:`Float16Overflow` when fp16 compute produced inf/NaN ``logits`` (other dtypes: no check)."""
    if dtype == torch.float16 and not bool(torch.isfinite(logits).all()):
        raise Float16Overflow(f"float16 overflows on this model: its activations exceed float16's range "
                              f"(65504) and the logits came out inf/NaN; {FIX}")


def probe_tokens(vocab_size: int, bos_token_id: int | None, n: int = PROBE_TOKENS) -> list[int]:
    """The load-time probe prompt: BOS (when the model has one), then ids spread evenly over the vocabulary."""
    ids = torch.linspace(0, vocab_size - 1, n).long().tolist()
    if isinstance(bos_token_id, int) and 0 <= bos_token_id < vocab_size:
        ids = [bos_token_id] + ids[:-1]
    return ids
