"""GPTQ (Frantar et al., 2022): quantize columns one at a time, spreading each rounding error over
the columns not yet quantized through the inverse Hessian of the layer's inputs, with lazy block
updates. Pure tensor functions: the caller accumulates ``H`` and logs the returned loss.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from compress.quant import QuantizedWeight, Scheme, find_params, mse_params, weighted_range_params


@dataclass
class Hessian:
    """Running mean of ``2 x^T x`` over calibration tokens."""

    H: Tensor
    n: int = 0

    @classmethod
    def zeros(cls, in_features: int) -> "Hessian":
        return cls(torch.zeros(in_features, in_features, dtype=torch.float32))

    def add(self, x: Tensor) -> None:
        # x: [..., in] -> [tokens, in]
        x = x.reshape(-1, x.shape[-1]).float()
        t = x.shape[0]
        self.H.mul_(self.n / (self.n + t))
        self.n += t
        x = x * (2 / self.n) ** 0.5
        self.H.addmm_(x.T, x)


@dataclass
class GPTQResult:
    weight: QuantizedWeight
    loss: float  # sum over columns of (w - q)^2 / (2 Hinv_ii^2), as in the reference


def _inverse_hessian_factor(H: Tensor, damp: float) -> Tensor:
    """Upper Cholesky factor of H^-1 after damping (the reference's ``Hinv``)."""
    H = H.clone()
    H.diagonal().add_(damp * H.diagonal().mean())
    L = torch.linalg.cholesky(H)
    del H  # each [in, in] intermediate goes as soon as the next exists: at width 14336 each is 0.77 GiB
    Hinv = torch.cholesky_inverse(L)
    del L
    return torch.linalg.cholesky(Hinv, upper=True)


def quantize_weight(W: Tensor, H: Tensor, scheme: Scheme, damp: float = 0.01, block_size: int = 128,
                    act_order: bool = False, static_groups: bool = False, mse: bool = False,
                    weighted_range: bool = False) -> GPTQResult:
    """GPTQ of ``W: [out, in]`` against the Hessian ``H: [in, in]``; ragged last groups allowed.
    With ``mse`` each group's grid is the clipped range that minimises the Hessian-diagonal-weighted
    rounding error (:func:`compress.quant.mse_params`) instead of its full min/max; with ``weighted_range``
    the range's two ends move independently and the error is the squared output error under the Hessian's
    diagonal (:func:`compress.quant.weighted_range_params`)."""
    W = W.detach().float().clone()
    out_f, in_f = W.shape
    H = H.float().clone()
    dead = H.diagonal() == 0
    H[dead, dead] = 1
    W[:, dead] = 0
    g = scheme.group(in_f)
    n_groups = scheme.n_groups(in_f)

    def params(w: Tensor, cols: Tensor | slice) -> tuple[Tensor, Tensor | None]:
        if weighted_range:  # w: [out, k <= g] is one group
            scale, zero = weighted_range_params(w, Scheme(scheme.bits, g, scheme.sym), hdiag[cols])
            return scale[:, 0], None if zero is None else zero[:, 0]
        return mse_params(w, scheme, hdiag[cols]) if mse else find_params(w, scheme)

    hdiag = H.diagonal().clone()  # the grid searches read only the diagonal (in the current column order)
    static = None
    if static_groups:  # qparams per natural-order group, fixed before any update
        static = [params(W[:, j * g:(j + 1) * g], slice(j * g, (j + 1) * g)) for j in range(n_groups)]
    perm = None
    if act_order:
        perm = torch.argsort(H.diagonal(), descending=True)
        W, H = W[:, perm], H[perm][:, perm]
        hdiag = H.diagonal().clone()
    Hinv = _inverse_hessian_factor(H, damp)
    del H  # only its diagonal is read from here on

    scales = torch.empty(out_f, n_groups, dtype=torch.float16)
    zeros = torch.empty(out_f, n_groups, dtype=torch.uint8) if scheme.has_zeros else None
    Q = torch.empty(out_f, in_f, dtype=torch.uint8)
    loss = torch.zeros((), dtype=torch.float32)
    if scheme.format != "int":
        raise ValueError(f"GPTQ quantizes to integer grids; format={scheme.format!r} is not supported (use nf4 recipe)")
    s = z = None  # current group's scale and zero as float columns

    for i1 in range(0, in_f, block_size):
        i2 = min(i1 + block_size, in_f)
        W1 = W[:, i1:i2].clone()
        Err1 = torch.zeros_like(W1)
        Hinv1 = Hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            if static is not None:
                gi = (perm[col].item() if perm is not None else col) // g
                scale, zero = static[gi]
                s, z = scale.float(), (scheme.sym_zero if zero is None else zero.float())
            elif col % g == 0:  # a new group starts: qparams from the error-updated weights
                # columns [col, col+g): the rest of this block is in W1, anything beyond in W
                group = torch.cat([W1[:, i:i + g], W[:, i2:col + g]], dim=1)
                scale, zero = params(group, slice(col, col + group.shape[1]))
                scales[:, col // g] = scale
                if zeros is not None:
                    zeros[:, col // g] = zero
                s, z = scale.float(), (scheme.sym_zero if zero is None else zero.float())
            w = W1[:, i]
            q = torch.clamp(torch.round(w / s) + z, 0, scheme.maxq)
            Q[:, col] = q.to(torch.uint8)
            wq = (q - z) * s
            d = Hinv1[i, i]
            loss += ((w - wq) ** 2).sum() / d**2 / 2
            err = (w - wq) / d
            W1[:, i:] -= err[:, None] * Hinv1[i, i:][None, :]
            Err1[:, i] = err
        W[:, i2:] -= Err1 @ Hinv[i1:i2, i2:]

    g_idx = None
    if static is not None:
        scales = torch.stack([s for s, _ in static], dim=1)
        if zeros is not None:
            zeros = torch.stack([z for _, z in static], dim=1)
    if perm is not None:
        inv = torch.argsort(perm)
        Q = Q[:, inv]
        if static is None:  # groups were formed in permuted order: record each column's group
            g_idx = (torch.arange(in_f) // g)[inv].to(torch.int32)
    return GPTQResult(QuantizedWeight(Q, scales, zeros, scheme, g_idx), loss.item())
