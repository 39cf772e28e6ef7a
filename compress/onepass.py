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

from compress.calibrate import backbone
from compress.guided import Key, gradient_pass, quantized_linears, token_weight
from compress.hessian import Hessian, InputOwners


def _outer(x: Tensor, w: Tensor | None, product: torch.dtype) -> Tensor:
    """``x^T diag(w) x`` for ``x: [..., in]`` and token weights ``w: [...]``, computed in ``product``."""
    x = x.detach().reshape(-1, x.shape[-1]).float()
    if w is not None:
        x = x * w.reshape(-1, 1).sqrt()
    x = x.to(product)
    return x.T @ x


class _Plain:
    """Running float32 totals of ``x^T x``, one per distinct input: linears fed the very same tensor (q/k/v) share
    one, as block-by-block calibration shares their Hessian."""

    def __init__(self, n_linears: int, product: torch.dtype):
        self.owners, self.sums, self.n_linears, self.product = InputOwners(), {}, n_linears, product

    def add(self, key: Key, x: Tensor) -> None:
        if self.owners.owns(key, x):
            total = self.sums.setdefault(key, torch.zeros(x.shape[-1], x.shape[-1]))
            total.add_(_outer(x, None, self.product))
        if len(self.owners.owner) == self.n_linears:  # every owner known: let the first inputs go
            self.owners.forget()

    def hessians(self, keys, tokens: int) -> dict[Key, Hessian]:
        # out of place: totals made in the forward's inference mode cannot be changed outside it
        own = {key: Hessian(self.sums.pop(key) * (2 / tokens), tokens, self.product) for key in list(self.sums)}
        return {key: own[self.owners.owner[key]] for key in keys}


def _forward(model: nn.Module, batches: list[Tensor], linears: dict[Key, nn.Linear], plain: _Plain,
             autocast: torch.dtype | None) -> None:
    """The fp model's forward over ``batches`` without its head, each linear's input into ``plain``."""
    def hook(key: Key):
        def fn(module, args) -> None:
            plain.add(key, args[0])
        return fn
    handles = [m.register_forward_pre_hook(hook(key)) for key, m in linears.items()]
    try:
        with torch.inference_mode(), torch.autocast("cpu", dtype=autocast or torch.bfloat16,
                                                    enabled=autocast is not None):
            for ids in batches:
                backbone(model)(input_ids=ids, use_cache=False)
    finally:
        for h in handles:
            h.remove()


def hessians(model: nn.Module, batches: list[Tensor], ignore: tuple[str, ...] = (), guided: bool = False,
             autocast: torch.dtype | None = None, mix: float = 1.0, guided_nsamples: int = 0) -> dict[Key, Hessian]:
    """Each quantized linear's Hessian over the calibration batches, by (block index, name in the block), its
    products computed in ``autocast`` (the recipe's calib_dtype) when given.
    - Plain: one forward, under ``autocast``; linears fed the very same tensor (q/k/v) share one Hessian object.
    - ``guided``: the gradient pass (compress/guided.py) over the first ``guided_nsamples`` sequences (0: all);
      every linear has its own Hessian, ``mix`` parts the one with each of those tokens counted by its weight
      ``||dL/dy||^2`` (normalised to mean 1) and ``1 - mix`` the plain one over every sequence (a forward pass,
      in bfloat16 as the gradient pass runs, covers the rest), as :func:`compress.guided.token_weights` weighs them."""
    linears = quantized_linears(model, ignore)
    product = autocast or torch.float32
    plain = _Plain(len(linears), product)
    tokens = sum(b.numel() for b in batches)
    if not guided:
        _forward(model, batches, linears, plain, autocast)
        return plain.hessians(linears, tokens)
    rows = torch.cat(batches)
    k = min(guided_nsamples or rows.shape[0], rows.shape[0])
    size = batches[0].shape[0]
    inputs: dict[Key, Tensor] = {}
    mass = dict.fromkeys(linears, 0.0)
    weighted = {key: torch.zeros(m.in_features, m.in_features) for key, m in linears.items()}

    def on_grad(key: Key, g: Tensor) -> None:
        x, w = inputs.pop(key), token_weight(g)
        mass[key] += float(w.sum())
        weighted[key].add_(_outer(x, w, product))
        if mix < 1:
            plain.add(key, x)
    gradient_pass(model, list(rows[:k].split(size)), linears, on_grad, inputs.__setitem__)
    if mix < 1 and k < rows.shape[0]:
        _forward(model, list(rows[k:].split(size)), linears, plain, torch.bfloat16)
    mixed = plain.hessians(linears, tokens) if mix < 1 else {}
    out = {}
    for key, total in weighted.items():  # 2 mix sum(w x x^T) / sum(w) + (1 - mix) H_plain
        h = Hessian(total.mul_(2 * mix / max(mass[key], 1e-30)), tokens, product)
        if mix < 1:
            h.H.add_(mixed[key].H, alpha=1 - mix)
        out[key] = h
    return out
