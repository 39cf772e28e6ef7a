"""Shared by both sides of the quantization benchmark (our venv and llm-compressor's): the same
token windows and the same mean-NLL protocol, with no import of compress (it runs in either venv)."""
from __future__ import annotations

import math

import torch


@torch.inference_mode()
def window_ppl(model, windows: torch.Tensor, batch_size: int = 8) -> float:
    """exp(mean NLL) over every predicted token of each [n, seqlen] window (no overlap, no context)."""
    total, count = 0.0, 0
    for batch in windows.split(batch_size):
        logits = model(input_ids=batch).logits[:, :-1].float()
        nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1),
                                                reduction="sum")
        total += nll.item()
        count += batch[:, 1:].numel()
    return math.exp(total / count)
