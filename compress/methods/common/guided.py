"""Gradient-guided token weights for GPTQ (after GuidedQuant, Kim et al. 2025, with one group of output channels):
the layer-wise objective ``E||(W - W_hat) x||^2`` counts every calibration token alike, while the model's loss
does not: an error at a linear's output moves the next-token loss by about ``g^T e``, with ``g`` the loss
gradient there. Weighting each token's ``x x^T`` in the Hessian by ``||g||^2`` (the Fisher's diagonal over
output channels, summed) makes GPTQ spend its precision on the tokens the loss is sensitive to.

One forward and backward pass of the fp model over the calibration batches, before any block is quantized, one
sequence at a time (one autograd graph and one sequence's logits in memory, whatever the batch size): for every
quantized linear, the squared norm of the next-token cross-entropy's gradient at its output, per token, normalised
to mean 1 over the calibration tokens. The pass runs under bfloat16 autocast (only the weights' magnitudes matter,
and it halves the time); the model's parameters get no gradients. Each decoder block's activations are recomputed
in the backward rather than kept (activation checkpointing): the graph otherwise holds every block's activations
and, under autocast, a bfloat16 copy of every weight (half the fp32 model again: 3 GB at 1.5B parameters), for one
more forward of the blocks. Linear weights that are bfloat16 values already (bfloat16 shards) are held as bfloat16
for the pass: no casts, half their memory, the same numbers.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Callable, Iterator

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from compress.calibrate import Progress, decoder_layers, layers_name, target_linears
from compress.format.host import trim

log = logging.getLogger(__name__)

TokenWeights = dict[tuple[int, str], list[Tensor]]  # (block index, linear name in the block) -> [batch, seq] per batch
Key = tuple[int, str]


def quantized_linears(model: nn.Module, ignore: tuple[str, ...] = ()) -> dict[Key, nn.Linear]:
    """Every linear the methods quantize, by (block index, name in the block), in the model's order."""
    prefix = layers_name(model)
    return {(i, n): m for i, block in enumerate(decoder_layers(model))
            for n, m in target_linears(block, ignore, f"{prefix}.{i}.").items()}


@contextlib.contextmanager
def recomputed(layers: nn.ModuleList) -> Iterator[None]:
    """Each block's forward under non-reentrant activation checkpointing: the backward recomputes what it needs
    from the block's input (module hooks fire in the recomputation too: forward hooks twice, backward hooks once)."""
    own = [layer.__dict__.get("forward") for layer in layers]
    for layer in layers:
        layer.forward = functools.partial(checkpoint, layer.forward, use_reentrant=False)
    try:
        yield
    finally:
        for layer, fwd in zip(layers, own):
            if fwd is None:
                del layer.forward
            else:
                layer.forward = fwd


@contextlib.contextmanager
def bfloat16_weights(linears: dict[Key, nn.Linear]) -> Iterator[int]:
    """Each linear's float32 weight whose every value is a bfloat16 (a checkpoint read from bfloat16 shards) held as
    bfloat16 while the pass runs, then restored, exactly: bfloat16 autocast would cast it to the same values at every
    call (twice a sequence with the blocks recomputed), so the pass computes the same numbers without the casts and
    with half those weights' memory. Yields how many were converted; weights that bfloat16 would round stay."""
    own = [lin.weight for lin in linears.values()
           if lin.weight.dtype == torch.float32 and torch.equal(lin.weight.data.bfloat16().float(), lin.weight.data)]
    for w in own:
        w.data = w.data.bfloat16()
    try:
        yield len(own)
    finally:
        for w in own:
            w.data = w.data.float()


def gradient_pass(model: nn.Module, batches: list[Tensor], linears: dict[Key, nn.Linear],
                  on_grad: Callable[[Key, Tensor], None], progress: Progress | None = None) -> None:
    """The fp model's forward and backward over every calibration sequence, one at a time (one graph and one
    sequence's logits in memory; the blocks checkpointed), under bfloat16 autocast, the next-token cross-entropy
    summed. ``on_grad(key, g)`` sees the loss gradient at each linear's output ``[1, seq, out]`` in the backward;
    ``progress(done, total, "sequence")`` after each sequence. The parameters get no gradients."""
    def backward_hook(key: Key):
        def fn(module, grad_in, grad_out) -> None:  # returns None: the gradients flow on unchanged
            on_grad(key, grad_out[0].detach())
        return fn

    handles = [lin.register_full_backward_hook(backward_hook(key)) for key, lin in linears.items()]
    # the parameters need no gradient: the embeddings' output is where the graph starts
    handles.append(model.get_input_embeddings().register_forward_hook(lambda m, a, out: out.requires_grad_(True)))
    frozen = [(p, p.requires_grad) for p in model.parameters()]
    for p, _ in frozen:
        p.requires_grad_(False)
    rows = [row for b in batches for row in b.split(1)]
    log.info("guided: the fp model's forward and backward over %d calibration sequences", len(rows))
    t0 = time.perf_counter()
    try:
        with recomputed(decoder_layers(model)), bfloat16_weights(linears) as exact:
            log.info("guided: %d of %d linear weights held as bfloat16 for the pass (exactly their values)", exact,
                     len(linears))
            if progress:
                progress(0, len(rows), "sequence")
            for done, ids in enumerate(rows, 1):
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    logits = model(input_ids=ids, use_cache=False).logits
                loss = nn.functional.cross_entropy(logits[0, :-1].float(), ids[0, 1:], reduction="sum")
                del logits
                loss.backward()
                del loss
                trim()  # the graph's freed chunks: glibc's heap otherwise grows ~25 MB a sequence (SmolLM2)
                if progress:
                    progress(done, len(rows), "sequence")
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
                  nsamples: int = 0, progress: Progress | None = None) -> TokenWeights:
    """Each quantized linear's per-token weight, one tensor per calibration batch: ``mix * ||dL/dy||^2 / m + (1 -
    mix)``, the gradient pass covering the first ``nsamples`` sequences (0: all; the others' gradient term is 0), ``m``
    the mean over every token. The Hessian they weigh, ``2 sum(w x x^T) / tokens``, is ``mix`` parts the
    gradient-weighted one over the covered tokens (``2 sum(g x x^T) / sum(g)``) and ``1 - mix`` the plain one over
    all. Small: one float per token and linear."""
    linears = quantized_linears(model, ignore)
    sums: dict[Key, list[Tensor]] = {key: [] for key in linears}
    rows = torch.cat(batches)
    k = min(nsamples or rows.shape[0], rows.shape[0])
    gradient_pass(model, list(rows[:k].split(batches[0].shape[0])), linears,
                  lambda key, g: sums[key].append(token_weight(g)), progress)
    sizes = [b.shape[0] for b in batches]
    out: TokenWeights = {}
    for key, covered in sums.items():  # backward visits each sequence once: the rows are in calibration order
        w = torch.cat(covered + [torch.zeros(rows.shape[0] - k, rows.shape[1])])
        out[key] = list((mix * w / w.mean().clamp_min(1e-30) + (1 - mix)).split(sizes))
    return out
