"""What a calibrated method observes of a decoder block's linears while the block runs on calibration batches: hooks
that keep each input's mean magnitude, a fixed random sample of its token rows, optionally its GPTQ Hessian, and the
whole batches entering a module (AWQ judges its attention scales on them)."""
from __future__ import annotations

import torch
from torch import Tensor

from compress.calibrate import BlockInputs
from compress.methods.common.hessian import Hessian


class Sampler:
    """Collects, per linear, the mean |x| over all tokens and a fixed random sample of token rows (and, given them,
    each distinct input's GPTQ Hessian and the whole batches entering the modules that judge a scale)."""

    def __init__(self, inputs: BlockInputs, n_tokens: int, seed: int, hessians: dict[str, Hessian] | None = None,
                 weights: dict[str, list[Tensor]] | None = None):
        gen = torch.Generator().manual_seed(seed)
        self.weights = weights  # guided GPTQ: each batch's token weights per linear (compress/methods/common/guided.py)
        # optional: the GPTQ Hessian of every input, accumulated over all tokens (linears that share an
        # input share one object, which only the first of them updates)
        self.hessians = hessians or {}
        self._owner = {}
        for name, h in self.hessians.items():
            self._owner.setdefault(id(h), name)
        per_batch = max(1, n_tokens // len(inputs.hidden))
        self.rows = [torch.randperm(h.shape[0] * h.shape[1], generator=gen)[:per_batch] for h in inputs.hidden]
        self.abs_sum: dict[str, Tensor] = {}
        self.count: dict[str, int] = {}
        self.samples: dict[str, list[Tensor]] = {}
        # whole sequences entering the modules that judge a scale (attention needs them whole): the first batches'
        # first sequences holding n_tokens
        self.module_tokens = n_tokens
        self.module_inputs: dict[str, list[tuple[Tensor, dict]]] = {}
        self._last: tuple | None = None  # (input, batch, its summary): see _summary

    def module_hook(self, name: str):
        def fn(module, args, kwargs):
            calls = self.module_inputs.setdefault(name, [])
            left = self.module_tokens - sum(h.shape[0] * h.shape[1] for h, _ in calls)
            if left > 0:  # nothing copied once the tokens are held
                kwargs = dict(kwargs)
                hidden = args[0] if args else kwargs.pop("hidden_states")
                batch, rows = hidden.shape[0], min(hidden.shape[0], -(-left // hidden.shape[1]))
                calls.append((hidden[:rows].float(), {k: first_rows(v, rows, batch) for k, v in kwargs.items()
                                                      if k not in ("past_key_values", "past_key_value", "use_cache")}))
        return fn

    def hook(self, name: str):
        def fn(module, args):
            calls = self.samples.setdefault(name, [])
            x, total, sample = self._summary(args[0], len(calls))
            h = self.hessians.get(name)
            if h is not None and self._owner[id(h)] == name:
                h.add(x, None if self.weights is None else self.weights[name][len(calls)])
            self.abs_sum[name] = self.abs_sum.get(name, 0) + total
            self.count[name] = self.count.get(name, 0) + x.shape[0]
            calls.append(sample)
        return fn

    def _summary(self, x_in: Tensor, batch: int) -> tuple[Tensor, Tensor, Tensor]:
        """``x_in`` as float32 rows, its column sums of |x| and its sampled rows, computed once for the linears that
        read the very same tensor in a row (q/k/v, gate/up: the same numbers, a third of the work)."""
        last = self._last
        if last is not None and last[0] is x_in and last[1] == batch:
            return last[2]
        x = x_in.reshape(-1, x_in.shape[-1]).float()
        summary = (x, x.abs().sum(0), x[self.rows[batch]])
        self._last = (x_in, batch, summary)
        return summary

    def release(self) -> None:
        """Let go of the last input held for its siblings (call when the block's forward is over)."""
        self._last = None

    def x_mean(self, name: str) -> Tensor:
        return self.abs_sum[name] / self.count[name]

    def x(self, name: str) -> Tensor:
        return torch.cat(self.samples[name])


def first_rows(value, rows: int, batch: int):
    """A module's keyword argument cut to the first ``rows`` sequences of a ``batch``: tensors whose first dimension
    is the batch (a 4-D attention mask), inside tuples too; the rest (positions and rotary tables shared by the
    batch, flags) as they are."""
    if rows == batch:
        return value
    if isinstance(value, Tensor) and value.dim() >= 2 and value.shape[0] == batch:
        return value[:rows]
    if isinstance(value, tuple):
        return tuple(first_rows(v, rows, batch) for v in value)
    return value
