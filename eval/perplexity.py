"""Perplexity with one fixed protocol, so numbers are comparable across models and runs.

Protocol: join the texts with "\\n\\n", tokenize once, cut non-overlapping windows of ``seqlen`` tokens
(the last partial window is dropped; ``max_windows`` keeps only the first windows), score every window
independently, and average the next-token NLL over all predicted tokens (``seqlen - 1`` per window);
ppl = exp(mean NLL).
"""
from __future__ import annotations

import math
from collections.abc import Callable
import torch
from torch import Tensor, nn

from compress.data import tokenize
from eval.result import PplResult

LOSS_CHUNK = 128  # positions per cross-entropy call: bounds the fp32 log-softmax temporaries


def window_nll_sum(logits: Tensor, ids: Tensor, chunk: int = LOSS_CHUNK) -> Tensor:
    """Summed next-token NLL of ``ids: [b, t]`` under ``logits: [b, t, vocab]``, computed in position chunks."""
    total = torch.zeros((), dtype=torch.float64, device=logits.device)
    t = ids.shape[1]
    for s in range(0, t - 1, chunk):
        e = min(s + chunk, t - 1)
        # logits at positions s..e-1 predict tokens s+1..e
        part = logits[:, s:e].float().reshape(-1, logits.shape[-1])
        total += nn.functional.cross_entropy(part, ids[:, s + 1:e + 1].reshape(-1), reduction="sum").double()
    return total


def token_windows(tokenizer, texts: list[str], seqlen: int, max_windows: int | None = None) -> Tensor:
    """The protocol's windows: ``[n_windows, seqlen]`` token ids of ``texts`` joined by blank lines."""
    if seqlen < 2 or (max_windows is not None and max_windows < 1):
        raise ValueError(f"seqlen={seqlen} must be >= 2 and max_windows={max_windows} >= 1")
    ids = tokenize(tokenizer, "\n\n".join(texts))
    n_windows = ids.numel() // seqlen
    if max_windows is not None:
        n_windows = min(n_windows, max_windows)
    if n_windows == 0:
        raise ValueError(f"the text has {ids.numel()} tokens, fewer than one window of seqlen={seqlen}: "
                         "use more text or a smaller --seqlen")
    return ids[:n_windows * seqlen].view(n_windows, seqlen)  # [n_windows, seqlen]


def model_device(model) -> torch.device:
    """Where a model's inputs go; an ONNX Runtime model has no parameters and takes CPU tensors."""
    params = getattr(model, "parameters", None)
    return next(iter(params()), torch.empty(0)).device if params else torch.device("cpu")


def mean_nll(model, windows: Tensor, batch_size: int = 8, progress: Callable[[int, int], None] | None = None,
             on_logits: Callable[[Tensor, Tensor], None] | None = None) -> float:
    """Mean next-token NLL over ``windows: [n, seqlen]``, scored ``batch_size`` windows at a time;
    ``on_logits(batch, logits)`` sees each batch's logits (e.g. to compare them with another model's)."""
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be >= 1")
    n = windows.shape[0]
    device = model_device(model)
    nll = torch.zeros((), dtype=torch.float64)
    if progress:
        progress(0, n)
    with torch.inference_mode():
        for b in range(0, n, batch_size):
            batch = windows[b:b + batch_size].to(device)
            logits = model(input_ids=batch).logits  # [b, seqlen, vocab]
            nll += window_nll_sum(logits, batch).cpu()
            if on_logits:
                on_logits(batch, logits)
            del logits
            if progress:
                progress(min(b + batch_size, n), n)
    return nll.item() / (n * (windows.shape[1] - 1))


def perplexity(model: nn.Module, tokenizer, texts: list[str], seqlen: int = 512, max_windows: int | None = None,
               batch_size: int = 8, progress: Callable[[int, int], None] | None = None) -> PplResult:
    """Perplexity of a causal LM (any module whose forward returns ``.logits``) on ``texts``;
    ``progress(windows_done, windows)`` is called after each batch."""
    windows = token_windows(tokenizer, texts, seqlen, max_windows)
    mean = mean_nll(model, windows, batch_size, progress)
    return PplResult(ppl=math.exp(mean), nll=mean, tokens=windows.shape[0] * (seqlen - 1), windows=windows.shape[0])
