"""GPTQ (Frantar et al., 2022), the method: the adapter that hooks a decoder block's linears to accumulate their
Hessians, then rounds each with the solver (methods/common/gptq_solver.py, which AWQ's GPTQ rounding and the
untied head's GPTQ share)."""
from __future__ import annotations

import dataclasses
import logging
from functools import partial

import torch
from torch import Tensor, nn

from compress.calibrate import BlockInputs, Run, autocast_of, layers_name, run_sequential, swap_linear, target_linears
from compress.config import QuantizeConfig
from compress.format import quant
from compress.methods.common import fallback, guided
from compress.methods.common.gptq_solver import observe, observe_held, quantize_weight
from compress.methods.common.hessian import Hessian, product_of
from compress.methods.common.moe import ExpertResult, intermediate
from compress.methods.common.report import LayerRecord
from compress.offload import empty_like

log = logging.getLogger(__name__)


def quantize_expert(w_gu: Tensor, w_down: Tensor, x: Tensor, act, cfg: QuantizeConfig) -> ExpertResult:
    """GPTQ of one MoE expert on its routed tokens ``x [n, H]``; the down projection's Hessian is taken on
    the outputs of the already quantized gate/up (sequential within the expert)."""
    h = Hessian.zeros(x.shape[1], product_of(cfg.gptq))
    h.add(x)
    gu = quantize_weight(w_gu, h.release(), cfg.scheme, cfg.gptq, cfg.weighted_range)
    inter = intermediate(x, gu.weight.dequantize(), act)
    h = Hessian.zeros(inter.shape[1], product_of(cfg.gptq))
    h.add(inter)
    dn = quantize_weight(w_down, h.release(), cfg.scheme, cfg.gptq, cfg.weighted_range)
    return ExpertResult(gu.weight, dn.weight, {"gate_up_proj": gu.loss, "down_proj": dn.loss})


def _natural(lin: nn.Linear, cfg: QuantizeConfig) -> Tensor:
    """Each input column's group in natural order: ``g_idx`` of a weight rounded without act-order."""
    return (torch.arange(lin.in_features) // cfg.scheme.group(lin.in_features)).to(torch.int32)


def pooled(H: Tensor, n: int, held: Hessian, share: float = 1.0) -> Tensor:
    """The Hessian of the fit windows (``H``, the mean over ``n`` tokens) and of the held-out ones together, each
    held-out token counted ``share`` times (guided GPTQ's weight for a token without gradients)."""
    return (H * n + held.H * (share * held.n)) / (n + held.n)


Held = dict[str, Hessian | fallback.Gram | fallback.Rows]  # the held-out windows' Hessians (refit), else judges


def _quantize_linears(i: int, block: nn.Module, linears: dict[str, nn.Linear], hessians: dict[str, Hessian],
                      cfg: QuantizeConfig, run: Run, held: Held | None = None, prefix: str = "") -> None:
    """GPTQ of each of a block's linears against its Hessian, swapped for its packed weight; given what judges the
    held-out windows (``held``: their Hessians with ``refit``, else ``observe_held``'s), RTN's weight where its
    output error there is smaller (compress/methods/common/fallback.py)."""
    keep, refit = run.latents is not None, held is not None and cfg.gptq.refit
    for name, lin in linears.items():
        h = hessians.pop(name)
        shared = any(other is h for other in hessians.values())  # q/k/v: the last of them takes it
        res = quantize_weight(lin.weight.data, h.H if shared or refit else h.release(), cfg.scheme, cfg.gptq,
                              cfg.weighted_range, keep_latent=keep)
        record, weight = LayerRecord(i, name, res.loss), res.weight
        if held is not None:
            plain = quant.quantize_weight(lin.weight.data, cfg.scheme)
            judge = fallback.Gram(held[name].H) if refit else held[name]
            choice = fallback.compare(lin.weight.data, res.weight.dequantize(), plain.dequantize(), judge)
            judged = choice.judgement()
            record = LayerRecord(i, name, res.loss, judged, names=[f"{prefix}{name}"])
            log.info("%s%s: held-out error gptq %.4g, rtn %.4g -> %s", prefix, name, judged.heldout_error,
                     judged.rtn_heldout_error, "rtn" if choice.rtn else "gptq")
            if choice.rtn:  # under act-order the checkpoint's linears all carry a g_idx: RTN's is the natural one
                weight = plain if res.weight.g_idx is None else dataclasses.replace(plain, g_idx=_natural(lin, cfg))
            elif refit:  # held-out tokens count as tokens without gradients do in guided GPTQ's Hessians
                share = 1 - cfg.gptq.guided_mix if cfg.gptq.guided else 1.0
                res = quantize_weight(lin.weight.data, pooled(h.H if shared else h.release(), h.n, held[name], share),
                                      cfg.scheme, cfg.gptq, cfg.weighted_range, keep_latent=keep)
                weight, record = res.weight, dataclasses.replace(record, loss=res.loss)
        run.report.layers.append(record)
        if run.latents is not None:
            run.latents[lin] = res.latent
        swap_linear(block, name, lin, weight)


def quantize(model: nn.Module, cfg: QuantizeConfig, run: Run) -> None:
    """GPTQ, block by block, then each block's MoE experts. Each block's Hessians are taken on the previous blocks'
    quantized outputs, or with ``sequential: false`` on the fp model's (the fp block's outputs, seen while its
    Hessians are taken, go on to the next block: one forward per block, not two). Products in float32, or with
    ``bf16_gram`` of the inputs rounded to bfloat16, summed in float32 (a bfloat16 matmul's rounded output is not
    positive definite: SmolLM2's block 0 o_proj even at damp 0.05).
    ``guided``: the gradient pass (compress/methods/common/guided.py) first weighs every token of each linear's Hessian. With
    held-out batches (``run.holdout``), GPTQ fits on the others and each linear keeps RTN where that is better on
    them (the MoE experts, not judged, fit on every batch)."""
    prefix = layers_name(model)
    fp = not cfg.gptq.sequential
    product = product_of(cfg.gptq)
    tw = guided.token_weights(model, run.fit_batches, cfg.ignore, cfg.gptq.guided_mix, cfg.gptq.guided_nsamples,
                              run.progress) if cfg.gptq.guided else None

    def per_block(i: int, block: nn.Module, inputs: BlockInputs) -> list[Tensor] | None:
        linears = target_linears(block, cfg.ignore, f"{prefix}.{i}.")
        weights = None if tw is None else {n: tw.pop((i, n)) for n in linears}
        fit_inputs, held_inputs = inputs.split(run.holdout)
        outputs = empty_like(inputs.hidden) if fp else None  # the fp block's, fit batches first, as they come in
        hessians = observe(block, linears, fit_inputs, weights, outputs, product)
        held = None if held_inputs is None else (observe if cfg.gptq.refit else observe_held)(
            block, linears, held_inputs, outputs=outputs, product=product)  # refit pools the held-out Hessians in
        _quantize_linears(i, block, linears, hessians, cfg, run, held, f"{prefix}.{i}.")
        if run.experts is not None:
            run.report.layers.extend(run.experts(i, block, inputs, partial(quantize_expert, cfg=cfg)))
        return outputs
    run_sequential(model, run.batches, per_block, run.progress, autocast_of(cfg.calib_dtype), run.store)
