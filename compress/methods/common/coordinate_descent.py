"""Coordinate descent over a quantized weight's codes, after GPTQ (CDQuant: Nair & Suggala, 2024).

GPTQ rounds each column once, in order, against the columns still to come; the columns before it are fixed by then.
A sweep here revisits every column with all the others fixed and moves each row's code to the grid point that
minimises the layer's quadratic error ``f = sum_rows (w - ŵ) H (w - ŵ)^T``. Along one coordinate ``f`` is a parabola
in ``ŵ_j`` with its minimum at ``ŵ_j + (E H)_j / H_jj`` (``E = W - Ŵ``), so the nearest grid point to it (clamped)
is the exact minimiser on the grid: no move raises ``f``. Scales and zeros stay as they are, so the checkpoint's
format does not change. ``G = E H`` is kept up to date row by row: a sweep costs one ``[rows moved, in]`` update per
column, and most codes do not move after GPTQ. The native kernel (runtime/kernels/cpu/cd.cpp) runs the same sweeps
row by row, where there is a compiler; this loop is its reference and the fallback.
"""
from __future__ import annotations

import torch
from torch import Tensor

from compress.format.quant import Scheme, dequantize


def refine(W: Tensor, H: Tensor, Q: Tensor, scales: Tensor, zeros: Tensor | None, group: Tensor, scheme: Scheme,
           passes: int) -> tuple[float, float]:
    """Up to ``passes`` sweeps over the columns of ``Q: [out, in]`` (uint8 codes, changed in place) against the
    target ``W: [out, in]`` and ``H: [in, in]``; column ``j`` is in group ``group[j]`` of ``scales`` and ``zeros``
    (:func:`compress.format.quant.dequantize` with that ``g_idx``). Stops early after a sweep that moves nothing.
    Returns ``f`` before and after."""
    maxq, sym_zero = scheme.maxq, scheme.sym_zero
    S = scales.float()
    Z = None if zeros is None else zeros.float()
    Wq = dequantize(Q, scales, zeros, scheme, g_idx=group)
    G = (W - Wq) @ H
    before = _objective(W, Wq, G)
    if _native():  # the same sweeps, one row per thread at a time (runtime/kernels/cpu/cd.cpp): bit for bit these
        torch.ops.compress_cpu.cd_sweeps_(Wq, G, Q, S.contiguous(), None if Z is None else Z.contiguous(),
                                          group.long().contiguous(), H.contiguous(), maxq, float(sym_zero), passes)
        return before, _objective(W, Wq, G)
    cols, d = range(W.shape[1]), H.diagonal()

    def dequant(j: int) -> tuple[Tensor, Tensor]:
        return S[:, group[j]], (sym_zero if Z is None else Z[:, group[j]])

    for _ in range(passes):
        moved = 0
        for j in cols:
            s, z = dequant(j)
            q = torch.clamp(torch.round((Wq[:, j] + G[:, j] / d[j]) / s) + z, 0, maxq)
            rows = (q != Q[:, j]).nonzero().squeeze(1)
            if not rows.numel():
                continue
            new = (q[rows] - (z if Z is None else z[rows])) * s[rows]
            G.index_add_(0, rows, (Wq[rows, j] - new)[:, None] * H[j][None, :])  # E's row j entries grow by old - new
            Wq[rows, j] = new
            Q[rows, j] = q[rows].to(Q.dtype)
            moved += rows.numel()
        if not moved:
            break
    return before, _objective(W, Wq, G)


def _native() -> bool:
    from runtime.kernels import cpu_ext

    return cpu_ext.load() and hasattr(torch.ops.compress_cpu, "cd_sweeps_")


def _objective(W: Tensor, Wq: Tensor, G: Tensor) -> float:
    return float(((W - Wq) * G).sum())
