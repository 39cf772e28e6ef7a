"""GPTQ's solver (Frantar et al., 2022): quantize a weight's columns one at a time, spreading each rounding
error over the columns not yet quantized through the inverse Hessian of the layer's inputs, with lazy block
updates; and :func:`observe`, the Hessians of a decoder block's linears. Pure tensor functions (the caller
accumulates ``H`` and logs the returned loss), shared by GPTQ (methods/gptq.py), AWQ's GPTQ rounding
(methods/awq.py) and the untied head's GPTQ (methods/head_gptq.py), which is why it is not in a method's file."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import Tensor, nn

from compress.calibrate import BlockInputs
from compress.config import GPTQOptions
from compress.format.quant import QuantizedWeight, Scheme, find_params, mse_params, weighted_range_params
from compress.methods.common import coordinate_descent, fallback
from compress.methods.common.hessian import Hessian, InputOwners

GroupParams = Callable[[Tensor, Tensor], tuple[Tensor, Tensor | None]]  # (w [out, k], H diagonal [k])


@dataclass
class GPTQResult:
    weight: QuantizedWeight
    loss: float  # sum over columns of (w - q)^2 / (2 Hinv_ii^2), as in the reference
    # with keep_latent: [out, in] fp32, each weight as GPTQ rounded it (after the earlier columns' error feedback);
    # round(latent / s) + z is its code: QAT's starting latent weight (compress/methods/qat.py)
    latent: Tensor | None = None


def _group_params(scheme: Scheme, g: int, mse: bool, weighted_range: bool, coarse: int = 0) -> GroupParams:
    """How one group's scale and zero are picked: min/max, the H-diagonal-weighted ``mse`` grid, or the
    weighted range whose two ends move independently."""
    def params(w: Tensor, hdiag: Tensor) -> tuple[Tensor, Tensor | None]:
        if weighted_range:  # w: [out, k <= g] is one group
            scale, zero = weighted_range_params(w, replace(scheme, group_size=g), hdiag)
            return scale[:, 0], None if zero is None else zero[:, 0]
        return mse_params(w, scheme, hdiag, coarse=coarse) if mse else find_params(w, scheme)
    return params


def _static_params(W: Tensor, hdiag: Tensor, scheme: Scheme, g: int, mse: bool, weighted_range: bool,
                   chunk: int = 1 << 18, coarse: int = 0) -> list[tuple[Tensor, Tensor | None]]:
    """Every natural-order group's qparams, the same as :func:`_group_params` gives them group by group, in a
    few calls: the weighted range takes all groups at once; otherwise the full groups are stacked as the rows
    of one matrix (each with its own slice of ``hdiag``), ``chunk`` elements a call, and a ragged last group
    goes alone."""
    if weighted_range:
        scale, zero = weighted_range_params(W, replace(scheme, group_size=g), hdiag)
        return [(scale[:, j], None if zero is None else zero[:, j]) for j in range(scale.shape[1])]

    def params(w: Tensor, c: Tensor) -> tuple[Tensor, Tensor | None]:
        return mse_params(w, scheme, c, coarse=coarse) if mse else find_params(w, scheme)
    out_f, in_f = W.shape
    n_full = in_f // g
    rows = max(1, chunk // g)
    stacked = W[:, :n_full * g].reshape(out_f, n_full, g).transpose(0, 1).reshape(-1, g)  # group-major rows
    weight = hdiag[:n_full * g].reshape(n_full, 1, g).expand(n_full, out_f, g).reshape(-1, g)
    parts = [params(w, c) for w, c in zip(stacked.split(rows), weight.split(rows))] if n_full else []
    groups = []
    if parts:
        scales = torch.cat([s for s, _ in parts]).reshape(n_full, out_f)
        zeros = None if parts[0][1] is None else torch.cat([z for _, z in parts]).reshape(n_full, out_f)
        groups = [(scales[j], None if zeros is None else zeros[j]) for j in range(n_full)]
    if in_f % g:
        groups.append(params(W[:, n_full * g:], hdiag[n_full * g:]))
    return groups


def quantize_weight(W: Tensor, H: Tensor, scheme: Scheme, opts: GPTQOptions = GPTQOptions(),
                    weighted_range: bool = False, keep_latent: bool = False) -> GPTQResult:
    """GPTQ of ``W: [out, in]`` against the Hessian ``H: [in, in]``; ragged last groups allowed.
    With ``opts.mse`` each group's grid is the clipped range that minimises the Hessian-diagonal-weighted
    rounding error (:func:`compress.format.quant.mse_params`) instead of its full min/max; with ``weighted_range``
    the range's two ends move independently and the error is the squared output error under the Hessian's
    diagonal (:func:`compress.format.quant.weighted_range_params`)."""
    if scheme.format != "int":
        raise ValueError(f"GPTQ quantizes to integer grids; format={scheme.format!r} is not supported (use nf4 recipe)")
    W = W.detach().float().clone()
    in_f = W.shape[1]
    hdiag = H.diagonal().float().clone()  # the grid searches read only the diagonal (in the current column order)
    dead = hdiag == 0
    hdiag[dead] = 1
    W[:, dead] = 0
    g = scheme.group(in_f)
    params = _group_params(scheme, g, opts.mse, weighted_range, opts.mse_coarse)
    static = None
    if opts.static_groups:  # qparams per natural-order group, fixed before any update
        static = _static_params(W, hdiag, scheme, g, opts.mse, weighted_range, coarse=opts.mse_coarse)
    perm = torch.argsort(hdiag, descending=True) if opts.act_order else None
    # Memory: H is never written; each [in, in] step below makes a new matrix and drops the one before it, so
    # two exist at a time, besides the caller's H if the caller still holds it (at width 14336 each is 0.77 GiB).
    if perm is not None:
        H = H.float().index_select(0, perm)  # two statements: the unpermuted H can go before the second copy
        H = H.index_select(1, perm)
        W, hdiag, dead = W[:, perm], hdiag[perm], dead[perm]
    else:
        H = H.float().clone()
    H[dead, dead] = 1
    ref = H.diagonal().median() if opts.damp_of == "median" else H.diagonal().mean()  # (no view of H outlives it)
    H.diagonal().add_(opts.damp * ref)
    target = (W.clone(), H.clone()) if opts.cd_passes else None  # what coordinate descent refines against
    H = torch.linalg.cholesky(H)
    H = torch.cholesky_inverse(H)
    Hinv = torch.linalg.cholesky(H, upper=True)  # the reference's Hinv: upper Cholesky factor of H^-1
    del H
    latent = torch.empty_like(W) if keep_latent else None
    Q, scales, zeros, loss = _quantize_columns(W, Hinv, hdiag, scheme, opts.block_size, params, static, perm, latent)
    del Hinv
    if static is not None:
        scales = torch.stack([s for s, _ in static], dim=1)
        zeros = None if zeros is None else torch.stack([z for _, z in static], dim=1)
    if target is not None:  # each column's group, in the order the columns are in now
        group = (perm if perm is not None and static is not None else torch.arange(in_f)) // g
        _, f = coordinate_descent.refine(*target, Q, scales, zeros, group, scheme, opts.cd_passes)
        loss = torch.tensor(f / 2)  # GPTQ's loss is half the same quadratic error
    res = _result(Q, scales, zeros, loss, scheme, static, perm)
    if latent is not None:
        res.latent = latent if perm is None else latent[:, torch.argsort(perm)]
    return res


def _quantize_columns(W: Tensor, Hinv: Tensor, hdiag: Tensor, scheme: Scheme, block_size: int, params: GroupParams,
                      static: list | None, perm: Tensor | None, latent: Tensor | None = None
                      ) -> tuple[Tensor, Tensor, Tensor | None, Tensor]:
    """The column loop with lazy block updates: codes [out, in], per-group scales and zeros, and the loss;
    ``latent`` (if given) receives each column as it was rounded."""
    out_f, in_f = W.shape
    g, n_groups = scheme.group(in_f), scheme.n_groups(in_f)
    scales = torch.empty(out_f, n_groups, dtype=torch.float16)
    zeros = torch.empty(out_f, n_groups, dtype=torch.uint8) if scheme.has_zeros else None
    Q = torch.empty(out_f, in_f, dtype=torch.uint8)
    loss = torch.zeros((), dtype=torch.float32)
    s = z = None  # current group's scale and zero as float columns
    for i1 in range(0, in_f, block_size):
        i2 = min(i1 + block_size, in_f)
        W1 = W[:, i1:i2].clone()
        Err1 = torch.zeros_like(W1)
        Hinv1 = Hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            if static is not None:
                scale, zero = static[(perm[col].item() if perm is not None else col) // g]
                s, z = scale.float(), (scheme.sym_zero if zero is None else zero.float())
            elif col % g == 0:  # a new group starts: qparams from the error-updated weights
                # columns [col, col+g): the rest of this block is in W1, anything beyond in W
                group = torch.cat([W1[:, i:i + g], W[:, i2:col + g]], dim=1)
                scale, zero = params(group, hdiag[col:col + group.shape[1]])
                scales[:, col // g] = scale
                if zeros is not None:
                    zeros[:, col // g] = zero
                s, z = scale.float(), (scheme.sym_zero if zero is None else zero.float())
            w = W1[:, i]
            if latent is not None:
                latent[:, col] = w
            q = torch.clamp(torch.round(w / s) + z, 0, scheme.maxq)
            Q[:, col] = q.to(torch.uint8)
            wq = (q - z) * s
            d = Hinv1[i, i]
            loss += ((w - wq) ** 2).sum() / d**2 / 2
            err = (w - wq) / d
            W1[:, i:] -= err[:, None] * Hinv1[i, i:][None, :]
            Err1[:, i] = err
        W[:, i2:] -= Err1 @ Hinv[i1:i2, i2:]
    return Q, scales, zeros, loss


def _result(Q: Tensor, scales: Tensor, zeros: Tensor | None, loss: Tensor, scheme: Scheme, static: list | None,
            perm: Tensor | None) -> GPTQResult:
    """The codes back in natural column order, and each column's group under act-order."""
    in_f = Q.shape[1]
    g_idx = None
    if perm is not None:
        inv = torch.argsort(perm)
        Q = Q[:, inv]
        if static is None:  # groups were formed in permuted order: record each column's group
            g_idx = (torch.arange(in_f) // scheme.group(in_f))[inv].to(torch.int32)
    return GPTQResult(QuantizedWeight(Q, scales, zeros, scheme, g_idx), loss.item())


# -- the Hessians of a block's linears, from hooks on them ----------------------------------------
def observe(block: nn.Module, linears: dict[str, nn.Linear], inputs: BlockInputs,
            weights: dict[str, list[Tensor]] | None = None, outputs: list[Tensor] | None = None,
            product: torch.dtype = torch.float32) -> dict[str, Hessian]:
    """Each linear's Hessian over the block's calibration inputs (its products in ``product``: Hessian); linears fed
    the very same tensor (q/k/v) share one, unless ``weights`` (per linear, each batch's token weights) tell their
    tokens apart. ``outputs``, when given, receives the block's outputs of that forward."""
    hessians = {n: Hessian.zeros(m.in_features, product) for n, m in linears.items()}
    owners = InputOwners()
    calls = dict.fromkeys(linears, 0)

    def hook(name):
        def fn(module, args):
            x = args[0]
            if weights is not None:
                hessians[name].add(x, weights[name][calls[name]])
                calls[name] += 1
            elif owners.owns(name, x):
                hessians[name].add(x)
        return fn

    handles = [m.register_forward_pre_hook(hook(n)) for n, m in linears.items()]
    try:
        inputs.forward(block, outputs)
    finally:
        for h in handles:
            h.remove()
    return hessians if weights is not None else {n: hessians[owners.owner[n]] for n in linears}


def observe_held(block: nn.Module, linears: dict[str, nn.Linear], inputs: BlockInputs,
                 outputs: list[Tensor] | None = None, product: torch.dtype = torch.float32
                 ) -> dict[str, fallback.Gram | fallback.Rows]:
    """What each linear is judged by on held-out windows (one forward of the block, as :func:`observe`): the token
    rows of a wide input feeding a narrow output (down_proj: ``fallback.rows_cheaper``), else its Hessian."""
    rows = {n for n, m in linears.items() if fallback.rows_cheaper(inputs.tokens, m.in_features, m.out_features)}
    kept: dict[str, list[Tensor]] = {n: [] for n in rows}

    def keep(name):
        return lambda module, args: kept[name].append(args[0].detach().reshape(-1, args[0].shape[-1]))
    handles = [linears[n].register_forward_pre_hook(keep(n)) for n in rows]
    try:
        grams = observe(block, {n: m for n, m in linears.items() if n not in rows}, inputs, outputs=outputs,
                        product=product)
    finally:
        for h in handles:
            h.remove()
    return {n: fallback.Rows(torch.cat(kept[n])) if n in rows else fallback.Gram(grams[n].H) for n in linears}
