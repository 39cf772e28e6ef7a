"""The engine's own forward as a scorer of token windows, so perplexity measures what is served.

``EngineLM(spec)(input_ids)`` returns ``.logits [b, t, vocab]`` like a transformers model, computed through a
``ModelRunner``: paged KV cache, the packed quantized kernels, the fused CPU kernels and the LM head exactly as
``compress serve`` runs them. ``mode="decode"`` feeds each window one token per step, all windows of the batch
side by side as sequences (the served decode path: batch-1..4 kernels for up to 4 windows); ``"prefill"``
scores each window in one forward (the prompt path). ``kv_cache_dtype`` picks the cache's storage and
``quant_kernel`` the quantized linears' kernels as EngineConfig's do (``"int8"``: perplexity through an 8-bit KV
cache).
"""
from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import Tensor

from runtime.cpu import resolve_dtype
from runtime.model_runner import ForwardItem, ModelRunner
from runtime.models.loader import open_checkpoint

MODES = ("decode", "prefill")


class EngineLM:
    """Scores ``[b, t]`` token windows through the serving engine's runner (see the module docstring)."""

    def __init__(self, spec: str, dtype: str = "auto", lm_head: str = "auto", mode: str = "decode",
                 max_len: int = 2048, batch_size: int = 4, block_size: int = 16, fused_cpu: bool = True,
                 kv_cache_dtype: str = "auto", quant_kernel: str = "auto", native_step: bool = True):
        if mode not in MODES:
            raise ValueError(f"mode={mode!r} is unknown; use one of {MODES}")
        ckpt = open_checkpoint(spec)
        self.dtype = resolve_dtype(dtype, "cpu", ckpt.stored_dtype, ckpt.quantized).dtype
        self.tokenizer, self.mode, self.max_len = ckpt.tokenizer, mode, max_len
        self.batch_size, self.per_seq = batch_size, -(-max_len // block_size)
        self.runner = ModelRunner(ckpt, self.per_seq * batch_size, block_size, self.dtype, "cpu", quant_kernel,
                                  max_len + 1, fused_cpu=fused_cpu, lm_head=lm_head, kv_cache_dtype=kv_cache_dtype,
                                  native_step=native_step)
        self.lm_head = self.runner.lm_head_kind

    def _tables(self, n: int) -> list[list[int]]:
        return [list(range(i * self.per_seq, (i + 1) * self.per_seq)) for i in range(n)]

    @torch.inference_mode()
    def _score(self, windows: Tensor) -> Tensor:
        """fp32 logits ``[n, t, vocab]`` of at most ``batch_size`` windows (fresh sequences each call)."""
        n, t = windows.shape
        tables = self._tables(n)
        if self.mode == "prefill":
            out = [self.runner.forward([ForwardItem(w.tolist(), 0, tables[i], t)]) for i, w in enumerate(windows)]
            return torch.stack(out)
        steps = [self.runner.forward([ForwardItem([int(windows[i, p])], p, tables[i], 1) for i in range(n)])
                 for p in range(t)]  # each [n, vocab]
        return torch.stack(steps, dim=1)

    def __call__(self, input_ids: Tensor) -> SimpleNamespace:
        if input_ids.shape[1] > self.max_len:
            raise ValueError(f"windows of {input_ids.shape[1]} tokens exceed max_len={self.max_len}; raise max_len")
        parts = [self._score(input_ids[i:i + self.batch_size]) for i in range(0, input_ids.shape[0], self.batch_size)]
        return SimpleNamespace(logits=torch.cat(parts))
