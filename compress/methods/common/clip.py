"""The clipping-range search (AWQ's, after Lin et al., 2023): shrink each (row, group)'s quantization range toward zero
by the factor whose rounding error on sample inputs is smallest, scored through each group's Gram matrix. Pure
tensor functions; compress/methods/awq.py runs them on each smoothed linear."""
from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from compress.format.quant import Scheme, fake_quantize_groups, group_index


def grouped(t: Tensor, scheme: Scheme) -> Tensor:
    """[rows, in] -> zero-padded [rows, G, g]."""
    rows, n = t.shape
    g, G = scheme.group(n), scheme.n_groups(n)
    return F.pad(t, (0, G * g - n)).reshape(rows, G, g)


class Bounds(NamedTuple):
    """Per (output row, group) clipping range ``[lo, hi]``, each ``[out, G]``."""

    lo: Tensor
    hi: Tensor


def full_range(wg: Tensor, scheme: Scheme) -> Bounds:
    """Each group's unclipped range of grouped weights ``wg: [out, G, g]``: min/max (through 0) for an asymmetric
    grid, +-absmax for a symmetric one."""
    if scheme.sym or scheme.format == "nf4":
        hi = wg.abs().amax(dim=-1)
        return Bounds(-hi, hi)
    return Bounds(wg.amin(dim=-1).clamp(max=0), wg.amax(dim=-1).clamp(min=0))


@torch.inference_mode()
def search_clip(x: Tensor, w: Tensor, scheme: Scheme, grid: int = 20, max_shrink: float = 0.5,
                chunk: int = 256) -> Bounds:
    """Shrink each group's quantization range (min/max for asymmetric, +-absmax for symmetric) by the
    factor in ``[1 - max_shrink, 1]`` that minimises the group's contribution to the output error on
    sample inputs ``x: [n, in]``. A group's error over the samples, mean_n (x_g . dq)^2, is dq C_g dq^T with
    C_g = x_g^T x_g / n, so each candidate costs [out, g] x [g, g] products per group instead of n-row ones."""
    xg = grouped(x.float(), scheme).permute(1, 0, 2)  # [G, n, g]
    gram = torch.bmm(xg.transpose(1, 2), xg) / x.shape[0]  # [G, g, g]
    return shrink_search(w, scheme, lambda dq: (torch.bmm(dq, gram) * dq).sum(dim=-1).T, grid, max_shrink, chunk)


def shrink_search(w: Tensor, scheme: Scheme, error: Callable[[Tensor], Tensor], grid: int, max_shrink: float,
                  chunk: int) -> Bounds:
    """Per (row, group), the shrink of the full range whose rounding error ``error(dq: [G, rows, g]) -> [rows, G]``
    is smallest, ``w``'s rows taken ``chunk`` at a time."""
    wg_all = grouped(w.float(), scheme)  # [out, G, g]
    lo_all, hi_all = full_range(wg_all, scheme)
    best_lo, best_hi = lo_all.clone(), hi_all.clone()
    for r0 in range(0, w.shape[0], chunk):  # rows in chunks bound the error tensor
        rows = slice(r0, r0 + chunk)
        wg = wg_all[rows]
        best_err = None
        for k in range(int(grid * max_shrink) + 1):
            f = 1 - k / grid
            lo, hi = lo_all[rows] * f, hi_all[rows] * f
            dq = fake_quantize_groups(torch.maximum(torch.minimum(wg, hi[..., None]), lo[..., None]), scheme) - wg
            err = error(dq.permute(1, 0, 2))  # [G, o, g] -> [o, G]
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
