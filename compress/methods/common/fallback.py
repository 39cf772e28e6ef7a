"""Never worse than RTN, by construction (issue 34): a calibrated method keeps plain round-to-nearest as a candidate
for each layer (each AWQ smoothing group) and keeps its own result only where that result's output error is no larger
on calibration windows it did not fit on. Pure functions: the split of the windows, a weight's held-out output error,
the choice, and the summary the report and the checkpoint carry; the methods' adapters call them and log."""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from compress.methods.common.report import FallbackNote, Judgement


class Split(NamedTuple):
    """The calibration batches a method fits on, and the held-out ones that judge its result."""

    fit: list[Tensor]
    held: list[Tensor]


def split_windows(batches: list[Tensor], share: float) -> Split:
    """The last ``share`` of the calibration windows (rounded; at least one, and at least one left to fit on) held
    out, both parts re-batched at the first batch's size; nothing is held out when fewer than two windows exist."""
    windows = torch.cat(batches)  # [n, seqlen]
    n, size = windows.shape[0], batches[0].shape[0]
    held = min(max(1, round(n * share)), n - 1)
    if held < 1:
        return Split(list(batches), [])
    return Split(list(windows[:n - held].split(size)), list(windows[n - held:].split(size)))


def output_error(delta: Tensor, H: Tensor) -> float:
    """``sum_rows delta H delta^T``: the squared output error of a weight off by ``delta: [out, in]`` on the inputs
    whose second moment is ``H: [in, in]`` (a Hessian of the held-out windows)."""
    d = delta.float()
    return (d @ H.float() * d).sum().item()


class Gram(NamedTuple):
    """A layer's held-out inputs as their second moment ``H`` (a GPTQ Hessian: the mean of ``2 x^T x``)."""

    H: Tensor

    def errors(self, deltas: list[Tensor]) -> list[float]:
        return [output_error(d, self.H) for d in deltas]


class Rows(NamedTuple):
    """A layer's held-out inputs as the token rows themselves ``x: [n, in]`` (any float dtype), on the same scale as
    :class:`Gram` (``2 / n |x delta^T|^2``): fewer products than forming ``x^T x`` where the input is wide and the
    output narrow (down_proj: :func:`rows_cheaper`)."""

    x: Tensor
    chunk: int = 2048

    def errors(self, deltas: list[Tensor]) -> list[float]:
        d = torch.cat([t.float() for t in deltas])  # [k * out, in]: one product for every candidate
        sums = torch.zeros(d.shape[0], dtype=torch.float64)
        for rows in self.x.split(self.chunk):
            sums += (rows.float() @ d.T).pow(2).sum(0, dtype=torch.float64)
        per = sums.split([t.shape[0] for t in deltas])
        return [(2 / self.x.shape[0] * s.sum()).item() for s in per]


def rows_cheaper(n: int, width: int, out: int, candidates: int = 3) -> bool:
    """Whether judging ``candidates`` weights ``[out, width]`` on ``n`` token rows directly (``k n width out``
    products) costs fewer than forming and reading their Gram matrix (``n width^2 + k out width^2``)."""
    return candidates * n * width * out < n * width * width + candidates * out * width * width


@dataclass
class Choice:
    """One layer's (or one smoothing group's) held-out output errors: the calibrated result's and RTN's; ``energy``
    is the fp output's own (the errors relative to it are what ``-v`` logs)."""

    error: float
    rtn_error: float
    energy: float

    @property
    def rtn(self) -> bool:
        """RTN wins only when strictly better: a tie keeps the calibrated result."""
        return self.rtn_error < self.error

    def judgement(self) -> Judgement:
        """The errors relative to the fp output's, and the choice, as the report carries them."""
        return Judgement(self.error / max(self.energy, 1e-30), self.rtn_error / max(self.energy, 1e-30),
                         "rtn" if self.rtn else "kept")


def compare(w: Tensor, calibrated: Tensor, rtn: Tensor, held: Gram | Rows) -> Choice:
    """The held-out errors of two effective (dequantized, unscaled) weights of the fp weight ``w: [out, in]``, and
    the fp output's own energy."""
    w = w.float()
    return Choice(*held.errors([w - calibrated.float(), w - rtn.float(), w]))


def combine(choices: list[Choice]) -> Choice:
    """A smoothing group's choice: its linears' errors summed (they fall back together or not at all)."""
    return Choice(sum(c.error for c in choices), sum(c.rtn_error for c in choices), sum(c.energy for c in choices))


def summary(decisions: dict[str, str], held_windows: int) -> FallbackNote:
    """What the checkpoint's quantization_config and the run's report carry: the counts, the layers that kept RTN."""
    fell = {name: c for name, c in decisions.items() if c == "rtn"}
    return FallbackNote(held_windows, len(decisions), len(fell), fell)
