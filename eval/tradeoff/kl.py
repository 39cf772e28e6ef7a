"""KL divergence of a variant's next-token distributions from the reference (fp) model's, per token, as
llama.cpp's ``llama-perplexity --kl-divergence`` reports it: KL(P_ref || Q) = sum_v p_v (log p_v - log q_v),
summarized by its mean and 99th percentile over every scored position."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

KL_CHUNK = 256  # positions per float64 log-softmax: bounds the temporaries at [chunk, vocab]


@dataclass(frozen=True)
class KLStats:
    mean: float
    p99: float
    median: float
    max: float
    tokens: int


def token_kl(ref_logits: Tensor, logits: Tensor, chunk: int = KL_CHUNK) -> Tensor:
    """Per-position KL(softmax(ref) || softmax(logits)) in float64: ``[b, t, vocab]`` x2 -> ``[b * t]``."""
    if ref_logits.shape != logits.shape:
        raise ValueError(f"KL needs logits of one shape (same windows, same vocabulary): "
                         f"{tuple(ref_logits.shape)} vs {tuple(logits.shape)}")
    ref = ref_logits.reshape(-1, ref_logits.shape[-1])  # [b * t, vocab]
    other = logits.reshape(-1, logits.shape[-1])
    out = torch.empty(ref.shape[0], dtype=torch.float64)
    for s in range(0, ref.shape[0], chunk):
        log_p = torch.log_softmax(ref[s:s + chunk].double(), dim=-1)
        log_q = torch.log_softmax(other[s:s + chunk].double(), dim=-1)
        # clamp: exact zeros from float64 rounding can come out a hair below 0
        out[s:s + chunk] = (log_p.exp() * (log_p - log_q)).sum(-1).clamp_min(0.0).cpu()
    return out


def summarize(kl: Tensor) -> KLStats:
    """Mean, 99th percentile (linear interpolation between order statistics), median and max."""
    if kl.numel() == 0:
        raise ValueError("no positions were scored: KL needs at least one window")
    kl = kl.double()
    q = torch.quantile(kl, torch.tensor([0.5, 0.99], dtype=torch.float64))
    return KLStats(mean=kl.mean().item(), p99=q[1].item(), median=q[0].item(), max=kl.max().item(),
                   tokens=kl.numel())
