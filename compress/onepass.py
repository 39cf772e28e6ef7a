"""Every quantized linear's GPTQ Hessian from one pass of the fp model (``sequential: false``).

GPTQ as the reference runs it goes block by block: a block's Hessians are taken on the outputs of the blocks
before it, already quantized, so its rounding can answer their errors. That costs two forwards of every block
on all calibration tokens (one to collect, one to hand the quantized outputs on). Taking every Hessian from the
fp model instead (llm-compressor's "basic" pipeline) costs one pass of the model and no block forwards; under
guided GPTQ that pass is the gradient pass it runs anyway, so the Hessians come with the token weights.

What it costs: every Hessian is held at once (the sum of ``in_features^2`` over the model's linears, fp32), and
the whole model is in memory for the pass, so it does not stream.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from compress.calibrate import decoder_layers
from compress.hessian import Hessian, InputOwners
from compress.guided import Key, gradient_pass, quantized_linears, token_weight


class _Done(Exception):
    """Raised after the last decoder block: the pass needs the linears' inputs, not the logits."""


def _stop(module, args, out):
    raise _Done


def hessians(model: nn.Module, batches: list[Tensor], ignore: tuple[str, ...] = (), guided: bool = False,
             autocast: torch.dtype | None = None, mix: float = 1.0) -> dict[Key, Hessian]:
    """Each quantized linear's Hessian over the calibration batches, by (block index, name in the block), its
    products computed in ``autocast`` (the recipe's calib_dtype) when given.
    - Plain: one forward, under ``autocast``; linears fed the very same tensor (q/k/v) share one Hessian object.
    - ``guided``: the gradient pass (compress/guided.py); every linear has its own Hessian, ``mix`` parts the one
      with each token counted by its weight ``||dL/dy||^2`` (normalised to mean 1) and ``1 - mix`` the plain one,
      as :func:`compress.guided.token_weights` with ``mix`` weighs them."""
    linears = quantized_linears(model, ignore)
    product = autocast or torch.float32
    hs = {key: Hessian.zeros(m.in_features, product) for key, m in linears.items()}
    if guided:
        return _guided(model, batches, linears, hs, mix)
    owners = InputOwners()

    def hook(key: Key):
        def fn(module, args):
            if owners.owns(key, args[0]):
                hs[key].add(args[0])
        return fn
    handles = [m.register_forward_pre_hook(hook(key)) for key, m in linears.items()]
    handles.append(decoder_layers(model)[-1].register_forward_hook(_stop))
    try:
        with torch.inference_mode(), torch.autocast("cpu", dtype=autocast or torch.bfloat16,
                                                    enabled=autocast is not None):
            for ids in batches:
                try:
                    model(input_ids=ids, use_cache=False)
                except _Done:
                    pass
                owners.forget()  # every owner is known after the first batch
    finally:
        for h in handles:
            h.remove()
    return {key: hs[owners.owner[key]] for key in linears}


def _outer(x: Tensor, w: Tensor | None, product: torch.dtype) -> Tensor:
    """``x^T diag(w) x`` for ``x: [..., in]`` and token weights ``w: [...]``, computed in ``product``."""
    x = x.detach().reshape(-1, x.shape[-1]).float()
    if w is not None:
        x = x * w.reshape(-1, 1).sqrt()
    x = x.to(product)
    return x.T @ x


def _guided(model: nn.Module, batches: list[Tensor], linears: dict[Key, nn.Linear], hs: dict[Key, Hessian],
            mix: float) -> dict[Key, Hessian]:
    """The sums of ``w x x^T`` (and of ``x x^T``, mix < 1) over every token, then ``hs`` their normalised mix. The sums
    are plain running totals in float32 (``hs``' own matrices): one addition per sequence, no rescaling."""
    inputs: dict[Key, Tensor] = {}
    mass = dict.fromkeys(linears, 0.0)
    plain: dict[Key, Tensor] = {}
    owners = InputOwners()  # the plain sums are shared as the plain pass shares its Hessians

    def on_grad(key: Key, g: Tensor) -> None:
        x, w, h = inputs.pop(key), token_weight(g), hs[key]
        mass[key] += float(w.sum())
        h.H.add_(_outer(x, w, h.product))
        if mix < 1 and owners.owns(key, x):
            plain.setdefault(key, torch.zeros_like(h.H)).add_(_outer(x, None, h.product))
        if len(owners.owner) == len(linears):  # every owner known: let the first sequence's inputs go
            owners.forget()
    gradient_pass(model, batches, linears, on_grad, inputs.__setitem__)
    tokens = sum(b.numel() for b in batches)
    for key, h in hs.items():  # 2 (mix sum(w x x^T) / sum(w) + (1 - mix) sum(x x^T) / n)
        h.H.mul_(2 * mix / max(mass[key], 1e-30))
        h.n = tokens
        if mix < 1:
            h.H.add_(plain[owners.owner[key]], alpha=2 * (1 - mix) / tokens)
    return hs
