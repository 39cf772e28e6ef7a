"""Gradient-guided token weights for GPTQ (after GuidedQuant, Kim et al. 2025, with one group of output channels):
the layer-wise objective ``E||(W - W_hat) x||^2`` counts every calibration token alike, while the model's loss
does not: an error at a linear's output moves the next-token loss by about ``g^T e``, with ``g`` the loss
gradient there. Weighting each token's ``x x^T`` in the Hessian by ``||g||^2`` (the Fisher's diagonal over
output channels, summed) makes GPTQ spend its precision on the tokens the loss is sensitive to.

One forward and backward pass of the fp model over the calibration batches, before any block is quantized, one
sequence at a time (one autograd graph and one sequence's logits in memory, whatever the batch size): for every
quantized linear, the squared norm of the next-token cross-entropy's gradient at its output, per token, normalised
to mean 1 over the calibration tokens. The pass runs under bfloat16 autocast (only the weights' magnitudes matter,
and it halves the time); the model's parameters get no gradients.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch
from torch import Tensor, nn

from compress.calibrate import decoder_layers, layers_name, target_linears

log = logging.getLogger(__name__)

TokenWeights = dict[tuple[int, str], list[Tensor]]  # (block index, linear name in the block) -> [batch, seq] per batch
Key = tuple[int, str]


def quantized_linears(model: nn.Module, ignore: tuple[str, ...] = ()) -> dict[Key, nn.Linear]:
    """Every linear the methods quantize, by (block index, name in the block), in the model's order."""
    prefix = layers_name(model)
    return {(i, n): m for i, block in enumerate(decoder_layers(model))
            for n, m in target_linears(block, ignore, f"{prefix}.{i}.").items()}


def gradient_pass(model: nn.Module, batches: list[Tensor], linears: dict[Key, nn.Linear],
                  on_grad: Callable[[Key, Tensor], None], on_input: Callable[[Key, Tensor], None] | None = None) -> None:
    """The fp model's forward and backward over every calibration sequence, one at a time (one graph and one
    sequence's logits in memory), under bfloat16 autocast, the next-token cross-entropy summed. ``on_input(key, x)``
    sees each linear's input in the forward, ``on_grad(key, g)`` the loss gradient at its output ``[1, seq, out]``
    in the backward (so a sequence's inputs are seen before its gradients; linears fed the same tensor are given
    that very object, still in the graph: detach it to keep it). The parameters get no gradients."""
    def backward_hook(key: Key):
        def fn(module, grad_in, grad_out) -> None:  # returns None: the gradients flow on unchanged
            on_grad(key, grad_out[0].detach())
        return fn

    def input_hook(key: Key):
        def fn(module, args) -> None:
            on_input(key, args[0])
        return fn
    handles = [lin.register_full_backward_hook(backward_hook(key)) for key, lin in linears.items()]
    if on_input is not None:
        handles += [lin.register_forward_pre_hook(input_hook(key)) for key, lin in linears.items()]
    # the parameters need no gradient: the embeddings' output is where the graph starts
    handles.append(model.get_input_embeddings().register_forward_hook(lambda m, a, out: out.requires_grad_(True)))
    frozen = [(p, p.requires_grad) for p in model.parameters()]
    for p, _ in frozen:
        p.requires_grad_(False)
    log.info("guided: the fp model's forward and backward over %d calibration batches", len(batches))
    t0 = time.perf_counter()
    try:
        for ids in (row for b in batches for row in b.split(1)):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = model(input_ids=ids, use_cache=False).logits
            loss = nn.functional.cross_entropy(logits[0, :-1].float(), ids[0, 1:], reduction="sum")
            loss.backward()
    finally:
        for h in handles:
            h.remove()
        for p, was in frozen:
            p.requires_grad_(was)
    log.info("guided: gradients in %.0f s", time.perf_counter() - t0)


def token_weight(g: Tensor) -> Tensor:
    """A sequence's per-token weights ``[1, tokens]`` from the gradient ``g: [..., out]`` at a linear's output:
    ``||g||^2``."""
    return g.float().pow(2).sum(-1).reshape(1, -1)


def token_weights(model: nn.Module, batches: list[Tensor], ignore: tuple[str, ...] = (), mix: float = 1.0,
                  nsamples: int = 0) -> TokenWeights:
    """Each quantized linear's per-token weight, one tensor per calibration batch: ``mix * ||dL/dy||^2 / m + (1 -
    mix)``, the gradient pass covering the first ``nsamples`` sequences (0: all; the others' gradient term is 0), ``m``
    the mean over every token. The Hessian they weigh is ``mix`` parts the gradient-weighted one over the covered
    tokens and ``1 - mix`` the plain one over all."""
    linears = quantized_linears(model, ignore)
    sums: dict[Key, list[Tensor]] = {key: [] for key in linears}
    rows = torch.cat(batches)
    k = min(nsamples or rows.shape[0], rows.shape[0])
    gradient_pass(model, list(rows[:k].split(batches[0].shape[0])), linears,
                  lambda key, g: sums[key].append(token_weight(g)))
    sizes = [b.shape[0] for b in batches]
    out: TokenWeights = {}
    for key, covered in sums.items():  # backward visits each sequence once: the rows are in calibration order
        w = torch.cat(covered + [torch.zeros(rows.shape[0] - k, rows.shape[1])])
        out[key] = list((mix * w / w.mean().clamp_min(1e-30) + (1 - mix)).split(sizes))
    return out
