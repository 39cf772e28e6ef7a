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

import torch
from torch import Tensor, nn

from compress.calibrate import decoder_layers, layers_name, target_linears

log = logging.getLogger(__name__)

TokenWeights = dict[tuple[int, str], list[Tensor]]  # (block index, linear name in the block) -> [batch, seq] per batch


def token_weights(model: nn.Module, batches: list[Tensor], ignore: tuple[str, ...] = ()) -> TokenWeights:
    """Each quantized linear's per-token weight ``||dL/dy||^2 / mean``, one tensor per calibration batch."""
    prefix = layers_name(model)
    sums: dict[tuple[int, str], list[Tensor]] = {}
    handles = []
    for i, block in enumerate(decoder_layers(model)):
        for name, lin in target_linears(block, ignore, f"{prefix}.{i}.").items():
            sums[(i, name)] = []

            def hook(module, grad_in, grad_out, key=(i, name)):
                sums[key].append(grad_out[0].detach().float().pow(2).sum(-1).reshape(1, -1))  # [1, seq]
            handles.append(lin.register_full_backward_hook(hook))
    # the parameters need no gradient: the embeddings' output is where the graph starts
    handles.append(model.get_input_embeddings().register_forward_hook(lambda m, a, out: out.requires_grad_(True)))
    frozen = [(p, p.requires_grad) for p in model.parameters()]
    for p, _ in frozen:
        p.requires_grad_(False)
    log.info("guided: the fp model's forward and backward over %d calibration batches", len(batches))
    t0 = time.perf_counter()
    try:
        for ids in (row for b in batches for row in b.split(1)):  # one sequence at a time: one graph, one logits
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
    sizes = [b.shape[0] for b in batches]
    out: TokenWeights = {}
    for key, rows in sums.items():  # backward visits each sequence once: the rows are in calibration order
        w = torch.cat(rows)
        out[key] = list((w / w.mean().clamp_min(1e-30)).split(sizes))
    return out
