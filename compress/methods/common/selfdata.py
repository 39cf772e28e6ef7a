"""Training windows that the fp model writes itself (LLM-QAT's data-free distillation, Liu et al., 2023).

Distilling only on calibration text fits the student to that text's domain: on SmolLM2, 400 training steps on
Wikipedia instead of 250 left held-out wiki perplexity where it was and raised LAMBADA's (fiction). Text sampled
from the teacher at temperature 1 covers what the teacher itself predicts, so a share of such windows keeps the
student close on text the calibration set lacks (measurements: BENCHMARKS.md, "What else moves LAMBADA").
Sampling starts from the model's BOS token (its EOS where it has none) and runs the full window: an EOS on the
way is a token like any other, after which the model starts anew.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from compress.calibrate import Progress
from compress.format.models import cache_kwarg


def start_token(config) -> int:
    """The id every sampled window starts from: ``bos_token_id``, else the (first) ``eos_token_id``."""
    for name in ("bos_token_id", "eos_token_id"):
        tid = getattr(config, name, None)
        tid = tid[0] if isinstance(tid, (list, tuple)) and tid else tid
        if isinstance(tid, int):
            return tid
    raise ValueError(f"{getattr(config, 'model_type', 'this model')} declares neither bos_token_id nor "
                     "eos_token_id, so there is no token to start sampling from; set self_data: 0")


@torch.no_grad()
def sample_windows(model: nn.Module, n: int, seqlen: int, seed: int = 0, batch_size: int = 32,
                   progress: Progress | None = None) -> Tensor:
    """``n`` windows of ``seqlen`` token ids, LongTensor [n, seqlen]: the start token, then tokens sampled one
    at a time from ``model``'s full next-token distribution (temperature 1, no top-k/top-p), with a KV cache.
    In the model's own dtype: under autocast every decode step casts every weight again (autocast caches casts of
    trained parameters only), which made a step slower, not faster (SmolLM2, batch 32, 1 CPU thread: 0.29 s in
    bf16 against 0.23 s in fp32). ``progress(done, n, "window")`` after each batch of windows."""
    if n < 1 or seqlen < 2:
        raise ValueError(f"sampling needs n >= 1 windows of seqlen >= 2 tokens, got n={n}, seqlen={seqlen}")
    from transformers import DynamicCache

    was_training = model.training
    model.eval()
    gen = torch.Generator().manual_seed(seed)
    first = start_token(model.config)
    cache_kw = cache_kwarg(model)
    windows = []
    try:
        for i in range(0, n, batch_size):
            ids = torch.full((min(batch_size, n - i), seqlen), first, dtype=torch.long)
            step_ids, cache = ids[:, :1], DynamicCache()
            for t in range(1, seqlen):
                logits = model(input_ids=step_ids, use_cache=True, **{cache_kw: cache}).logits
                probs = torch.softmax(logits[:, -1].float(), dim=-1)  # [b, vocab]
                ids[:, t] = torch.multinomial(probs, 1, generator=gen).squeeze(1)
                step_ids = ids[:, t:t + 1]
            windows.append(ids)
            if progress:
                progress(i + ids.shape[0], n, "window")
    finally:
        model.train(was_training)
    return torch.cat(windows)
