"""GPTQ of the LM head on the final hidden states (issue 32): the head is the largest single matrix of a
large-vocabulary model and its rounding error shows directly in the logits, so it is rounded against the Hessian of
what it reads, the quantized body's final (normed) hidden states over the calibration windows, and keeps plain RTN
where that is better on the held-out windows (compress/methods/common/fallback.py), as the body's linears do.

Only the backbone runs (the hidden states are ``[batch, seqlen, hidden]``): the full-vocabulary logits of the
calibration tokens are never made; a streamed run hands over its last block's outputs instead (:func:`final_hessians`). A tied table is calibrated the same way and the embedding's lookups read the same
codes: GPTQ's error feedback moves each row off its own nearest grid points, which the lookups see, but on SmolLM2's
tied int4 table the head's gain outweighs it (scripts/bench/untie.py --head-as-embedding, scripts/bench/head_kl.py).
The held-out comparison judges the head's products only."""
from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from compress.calibrate import Progress, autocast_of, backbone
from compress.config import GPTQOptions, QuantizeConfig
from compress.format.quant import QuantizedWeight, Scheme, quantize_weight
from compress.methods.common import fallback, gptq_solver
from compress.methods.common.hessian import Hessian
from compress.methods.common.report import HeadNote
from compress.format.families import family

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HeadHessians:
    """The head inputs' Hessians on the windows GPTQ fits on, and on the held-out ones (None: nothing held out)."""

    fit: Tensor
    held: Tensor | None


@dataclass(frozen=True)
class HeadResult:
    """The head's codes, GPTQ's loss, and (with held-out windows) the comparison that picked GPTQ or RTN."""

    weight: QuantizedWeight
    loss: float
    choice: fallback.Choice | None = None

    @property
    def method(self) -> str:
        return "rtn" if self.choice is not None and self.choice.rtn else "gptq"

    def note(self, seconds: float = 0.0) -> HeadNote:
        """What the report and the checkpoint's quantization_config carry (``seconds``: the pass's time)."""
        return HeadNote(self.method, self.loss, self.choice.judgement() if self.choice else None, seconds)


HEAD_SLAB_ROWS = 8192  # rows GPTQ rounds at a time: each row against the same Hessian, apart from the others


def quantize_head(w: Tensor, hessians: HeadHessians, scheme: Scheme, opts: GPTQOptions = GPTQOptions(),
                  slab: int = HEAD_SLAB_ROWS) -> HeadResult:
    """GPTQ of the head ``w: [vocab, hidden]`` against ``hessians.fit`` (natural column order: a table's groups are
    consecutive columns); RTN's codes instead where they are strictly better on ``hessians.held``. Without the
    recipe's act-order and coordinate descent (``cd_passes``: not measured on a head).

    ``slab`` rows at a time: GPTQ's column loop updates each row from that row alone, so the codes are those of one
    pass over the whole head, while the fp32 working copies, the candidates and their held-out errors are a slab's
    (a 151,936 x 1,536 head: ~0.4 GiB of them instead of ~5 GiB) and the loop's columns stay in cache."""
    gopts = GPTQOptions(damp=opts.damp, damp_of=opts.damp_of, block_size=opts.block_size, mse=opts.mse)
    parts, choices, loss = [], [], 0.0
    for rows in w.split(slab):
        res = gptq_solver.quantize_weight(rows, hessians.fit, scheme, gopts)
        parts.append(res.weight)
        loss += float(res.loss)
        if hessians.held is not None:
            plain = quantize_weight(rows.float(), scheme).dequantize()
            choices.append(fallback.compare(rows, res.weight.dequantize(), plain, fallback.Gram(hessians.held)))
    choice = fallback.combine(choices) if choices else None
    if choice is not None and choice.rtn:
        parts = [quantize_weight(rows.float(), scheme) for rows in w.split(slab)]
    return HeadResult(_joined(parts), loss, choice)


def _joined(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """Consecutive row slabs' codes as one weight."""
    zeros = None if parts[0].zero is None else torch.cat([p.zero for p in parts])
    return QuantizedWeight(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]), zeros,
                           parts[0].scheme)


def _accumulate(states: Iterable[Tensor], n: int, held: int, progress: Progress | None) -> HeadHessians:
    """The Hessians of ``n`` batches of head inputs ``[batch, seqlen, hidden]``, the last ``held`` apart."""
    fit = out = None
    if progress:
        progress(0, n, "head batch")
    for i, x in enumerate(states):
        if fit is None:
            fit, out = Hessian.zeros(x.shape[-1]), Hessian.zeros(x.shape[-1]) if held else None
        (out if i >= n - held else fit).add(x)
        if progress:
            progress(i + 1, n, "head batch")
    return HeadHessians(fit.release(), None if out is None else out.release())


@torch.inference_mode()
def head_hessians(model: nn.Module, batches: list[Tensor], held: int = 0, autocast: torch.dtype | None = None,
                  progress: Progress | None = None) -> HeadHessians:
    """The Hessians of the head's inputs: the backbone's last hidden states (after the final norm) for each batch of
    token ids, the last ``held`` batches apart (``progress`` counts the batches: "head batch")."""
    base = backbone(model)
    with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        return _accumulate((base(input_ids=ids, use_cache=False)[0] for ids in batches), len(batches), held, progress)


@torch.inference_mode()
def final_hessians(norm: nn.Module, outputs: list[Tensor], held: int = 0, autocast: torch.dtype | None = None,
                   progress: Progress | None = None) -> HeadHessians:
    """The same Hessians from the last decoder block's outputs (a streamed run's, compress/stream.py): the final norm
    applied to each batch, as the backbone's forward does before the head."""
    with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        return _accumulate((norm(h) for h in outputs), len(outputs), held, progress)


def held_batches(cfg: QuantizeConfig, batches: list[Tensor]) -> tuple[list[Tensor], int]:
    """The windows in the order the pipeline quantizes on (compress/pipeline.py), and how many batches at the end are
    held out (the last ``cfg.holdout`` share when ``cfg.fallback`` is on)."""
    if not cfg.fallback:
        return batches, 0
    split = fallback.split_windows(batches, cfg.holdout)
    return split.fit + split.held, len(split.held)


def calibrate_head(model: nn.Module, cfg: QuantizeConfig, scheme: Scheme, batches: list[Tensor],
                   progress: Progress | None = None, outputs: list[Tensor] | None = None,
                   weight: Tensor | None = None) -> HeadResult:
    """The adapter: the head of ``model`` (its body already quantized; tied or not) rounded by :func:`quantize_head` on
    ``batches``, the last ``cfg.holdout`` share held out when ``cfg.fallback`` is on. A streamed run gives the last
    block's ``outputs`` on those windows (in :func:`held_batches`' order) and the head's ``weight`` read apart."""
    windows, held = held_batches(cfg, batches)
    autocast = autocast_of(cfg.calib_dtype)
    if outputs is None:
        hs = head_hessians(model, windows, held, autocast, progress)
    else:
        norm = model.get_submodule(family(model.config.model_type).final_norm)
        hs = final_hessians(norm, outputs, held, autocast, progress)
    w = model.get_output_embeddings().weight.data if weight is None else weight
    res = quantize_head(w, hs, scheme, cfg.gptq)
    if res.choice is not None:
        judged = res.choice.judgement()
        log.info("lm_head: held-out error gptq %.4g, rtn %.4g -> %s", judged.heldout_error, judged.rtn_heldout_error,
                 res.method)
    return res
