"""AWQ (Lin et al., 2023): protect the weight channels that see large activations by scaling them up
before rounding (and the feeding op down), then search a clipping range per group. Pure tensor
functions; which op feeds which linears is data in compress/mappings.py, applied by compress/pipeline.py.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from compress.quant import Scheme, fake_quantize, fake_quantize_groups, group_index


@dataclass
class ScaleResult:
    scales: Tensor  # [in] per input channel; multiply weight columns, divide the feeding op
    ratio: float  # the chosen exponent on the activation magnitude
    loss: float  # output MSE at the chosen ratio
    base_loss: float  # output MSE of plain RTN (ratio 0)


def weight_mean(weights: list[Tensor], scheme: Scheme) -> Tensor:
    """Mean over output rows of each input channel's |w| relative to its group's max: [in]."""
    w = torch.cat([x.float() for x in weights])
    wg = _grouped(w.abs(), scheme)  # [rows, G, g]
    wg = wg / wg.amax(dim=-1, keepdim=True).clamp(min=1e-8)
    return wg.reshape(w.shape[0], -1)[:, :w.shape[1]].mean(dim=0)


@torch.inference_mode()
def search_scale(x_mean: Tensor, weights: list[Tensor], scheme: Scheme,
                 forward: Callable[[list[Tensor]], Tensor], reference: Tensor, grid: int = 20,
                 duo: bool = True) -> ScaleResult:
    """Grid over r in [0, 1) of ``s = x_mean ** r`` (with ``duo``: ``x_mean ** r / w_mean ** (1 - r)``, as
    AutoAWQ and llm-compressor do), minimising the MSE of ``forward`` with fake-quantized scaled weights
    against ``reference``. r = 0 without duo is plain RTN, always a candidate."""
    x_mean = x_mean.float().clamp(min=1e-4)
    w_mean = weight_mean(weights, scheme).clamp(min=1e-4) if duo else None
    best = None
    base = None
    for k in range(grid):
        ratio = k / grid
        if w_mean is None or k == 0:
            candidates = [x_mean.pow(ratio)]
        else:
            candidates = [x_mean.pow(ratio) / w_mean.pow(1 - ratio)]
        for s in candidates:
            s = s / (s.max() * s.min()).sqrt()  # centre the scales around 1
            ws = [fake_quantize(w.float() * s, scheme) / s for w in weights]
            loss = F.mse_loss(forward(ws).float(), reference.float()).item()
            if base is None:
                base = loss
            if best is None or loss < best[0]:
                best = (loss, ratio, s)
    loss, ratio, s = best
    return ScaleResult(s, ratio, loss, base)


def _grouped(t: Tensor, scheme: Scheme) -> Tensor:
    """[rows, in] -> zero-padded [rows, G, g]."""
    rows, n = t.shape
    g, G = scheme.group(n), scheme.n_groups(n)
    return F.pad(t, (0, G * g - n)).reshape(rows, G, g)


class Bounds(NamedTuple):
    """Per (output row, group) clipping range ``[lo, hi]``, each ``[out, G]``."""

    lo: Tensor
    hi: Tensor


@torch.inference_mode()
def search_clip(x: Tensor, w: Tensor, scheme: Scheme, grid: int = 20, max_shrink: float = 0.5,
                chunk: int = 256) -> Bounds:
    """Shrink each group's quantization range (min/max for asymmetric, +-absmax for symmetric) by the
    factor in ``[1 - max_shrink, 1]`` that minimises the group's contribution to the output error on
    sample inputs ``x: [n, in]``."""
    xg = _grouped(x.float(), scheme).permute(1, 0, 2)  # [G, n, g]
    wg_all = _grouped(w.float(), scheme)  # [out, G, g]
    if scheme.sym or scheme.format == "nf4":
        hi_all = wg_all.abs().amax(dim=-1)
        lo_all = -hi_all
    else:
        lo_all, hi_all = wg_all.amin(dim=-1).clamp(max=0), wg_all.amax(dim=-1).clamp(min=0)
    best_lo, best_hi = lo_all.clone(), hi_all.clone()
    for r0 in range(0, w.shape[0], chunk):  # rows in chunks bound the [G, n, rows] error tensor
        rows = slice(r0, r0 + chunk)
        wg = wg_all[rows]
        best_err = None
        for k in range(int(grid * max_shrink) + 1):
            f = 1 - k / grid
            lo, hi = lo_all[rows] * f, hi_all[rows] * f
            dq = fake_quantize_groups(torch.maximum(torch.minimum(wg, hi[..., None]), lo[..., None]), scheme) - wg
            err = torch.bmm(xg, dq.permute(1, 2, 0)).pow_(2).mean(dim=1).T  # [G, n, o] -> [o, G]
            if best_err is None:
                best_err = err
                continue
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_lo[rows] = torch.where(better, lo, best_lo[rows])
            best_hi[rows] = torch.where(better, hi, best_hi[rows])
    return Bounds(best_lo, best_hi)


def clip_weight(w: Tensor, bounds: Bounds, scheme: Scheme) -> Tensor:
    """Clamp each (row, group) of ``w`` to its ``[lo, hi]``."""
    gi = group_index(w.shape[1], scheme, w.device)
    lo, hi = (b.index_select(1, gi).to(w.dtype) for b in bounds)
    return torch.maximum(torch.minimum(w, hi), lo)
