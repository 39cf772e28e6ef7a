"""AWQ (Lin et al., 2023): protect the weight channels that see large activations by scaling them up
before rounding (and the feeding op down), then search a clipping range per group. Pure tensor
functions at the top; below them the adapter that samples a decoder block's inputs with hooks and
applies the smoothing in place (which op feeds which linears is data, compress/format/mappings.py), and the
same steps for one MoE expert (its up -> down pair).
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call

from compress.calibrate import BlockInputs, Run, autocast_of, layers_name, run_sequential, swap_linear, target_linears
from compress.config import QuantizeConfig
from compress.format.mappings import BlockMap, Smooth, block_map
from compress.format.quant import QuantizedWeight, Scheme, fake_quantize, quantize_weight
from compress.methods.common import fallback, guided
from compress.methods.common.clip import clip_weight, full_range, grouped, search_clip
from compress.methods.common.sampler import Sampler
from compress.methods.common import gptq_solver
from compress.methods.common.grid import grid_order
from compress.methods.common.hessian import product_of
from compress.methods.common.moe import ExpertResult, intermediate
from compress.methods.common.report import LayerRecord, Record, SmoothRecord

log = logging.getLogger(__name__)


@dataclass
class ScaleResult:
    scales: Tensor  # [in] per input channel; multiply weight columns, divide the feeding op
    ratio: float  # the chosen exponent on the activation magnitude
    loss: float  # output MSE at the chosen ratio
    base_loss: float  # output MSE of plain RTN (ratio 0)


def weight_mean(weights: list[Tensor], scheme: Scheme) -> Tensor:
    """Mean over output rows of each input channel's |w| relative to its group's max: [in]."""
    w = torch.cat([x.float() for x in weights])
    wg = grouped(w.abs(), scheme)  # [rows, G, g]
    wg = wg / wg.amax(dim=-1, keepdim=True).clamp(min=1e-8)
    return wg.reshape(w.shape[0], -1)[:, :w.shape[1]].mean(dim=0)


def output_error(forward: Callable[[list[Tensor]], Tensor], reference: Tensor) -> Callable[[list[Tensor]], float]:
    """The MSE of ``forward(weights)`` against ``reference`` (a module's output, e.g. attention's)."""
    return lambda ws: F.mse_loss(forward(ws).float(), reference.float()).item()


def linear_error(x: Tensor, weights: list[Tensor], dtype: torch.dtype | None = None) -> Callable[[list[Tensor]], float]:
    """The MSE of the linears' concatenated outputs ``x @ w.T`` (``x [n, in]``) for candidate weights against the
    given ones: ``sum_i |x dW_i^T|^2 / (n out)``, through the Gram matrix ``x^T x`` where ``in < n`` (the same
    number, ``sum_i tr(dW_i G dW_i^T)``, at ``in / n`` of the products: 4.6x fewer for 4,096 rows of an
    896-wide input), else on ``x`` itself, its products in ``dtype`` where given (``search_dtype``)."""
    x = x.float()
    n, width = x.shape
    out = sum(w.shape[0] for w in weights)
    base = [w.float() for w in weights]
    if width < n:
        gram = x.T @ x
        return lambda ws: sum(((d := w - w0) @ gram * d).sum().item() for w, w0 in zip(ws, base)) / (n * out)
    dt = dtype or torch.float32
    xd = x.to(dt)
    return lambda ws: sum((xd @ (w - w0).to(dt).T).float().pow(2).sum().item() for w, w0 in zip(ws, base)) / (n * out)


@torch.inference_mode()
def search_scale(x_mean: Tensor, weights: list[Tensor], scheme: Scheme, error: Callable[[list[Tensor]], float],
                 grid: int = 20, duo: bool = True, coarse: int = 0) -> ScaleResult:
    """Grid over r = k / grid in [0, 1) of ``s = x_mean ** r`` (with ``duo``: ``x_mean ** r / w_mean ** (1 - r)``, as
    AutoAWQ and llm-compressor do), minimising the output ``error`` of the fake-quantized scaled weights
    (:func:`linear_error`, :func:`output_error`), every point or coarse to fine (compress/methods/common/grid.py).
    r = 0 without duo is plain RTN, always a candidate."""
    x_mean = x_mean.float().clamp(min=1e-4)
    w_mean = weight_mean(weights, scheme).clamp(min=1e-4) if duo else None
    scales: dict[int, Tensor] = {}
    losses: dict[int, float] = {}

    def loss(k: int) -> float:
        ratio = k / grid
        s = x_mean.pow(ratio) if w_mean is None or k == 0 else x_mean.pow(ratio) / w_mean.pow(1 - ratio)
        scales[k] = s = s / (s.max() * s.min()).sqrt()  # centre the scales around 1
        losses[k] = error([fake_quantize(w.float() * s, scheme) / s for w in weights])
        return losses[k]
    best = grid_order(grid, coarse)(loss)
    return ScaleResult(scales[best], best / grid, losses[best], losses[0])


# -- the adapter: hooks that sample a decoder block's inputs, the smoothing applied in place ----------
class Rounded(NamedTuple):
    weight: QuantizedWeight
    loss: float | None  # GPTQ's, when it rounded
    clip: float = 1.0  # the clipped ranges' mean share of the full ones (1: no clipping)


def round_weight(w: Tensor, x: Tensor, H: Tensor | None, cfg: QuantizeConfig, clip: bool) -> Rounded:
    """The last step for one smoothed linear, dense or expert: clip on the first ``clip_tokens`` rows of its
    sampled inputs ``x [n, in]``, then round by RTN (weighted by ``x``'s energy with ``weighted_range``) or,
    given its Hessian ``H``, by GPTQ (the config's gptq options)."""
    scheme, opts = cfg.scheme, cfg.awq
    kept = 1.0
    if clip:
        bounds = search_clip(x[:opts.clip_tokens], w, scheme, opts.clip_grid)
        full = full_range(grouped(w.float(), scheme), scheme)
        kept = ((bounds.hi - bounds.lo) / (full.hi - full.lo).clamp(min=1e-12)).mean().item()
        w = clip_weight(w, bounds, scheme)
    if H is None:
        energy = x.pow(2).mean(0) if cfg.weighted_range else None
        return Rounded(quantize_weight(w, scheme, energy), None, kept)
    res = gptq_solver.quantize_weight(w, H, scheme, cfg.gptq, cfg.weighted_range)
    return Rounded(res.weight, res.loss, kept)


def _shared_hessians(linears: dict[str, nn.Module], bmap: BlockMap, guided: bool,
                     product: torch.dtype) -> dict[str, gptq_solver.Hessian]:
    """One GPTQ Hessian per distinct input: the linears a norm smooths together read the same tensor (unless guided:
    then each linear weights the tokens by its own outputs' gradients)."""
    out: dict[str, gptq_solver.Hessian] = {}
    for sm in bmap.smooths:
        if not guided and all(n in linears for n in sm.linears):
            h = gptq_solver.Hessian.zeros(linears[sm.linears[0]].in_features, product)
            out.update({n: h for n in sm.linears})
    for name, lin in linears.items():
        if name not in out:
            out[name] = gptq_solver.Hessian.zeros(lin.in_features, product)
    return out


def _batches_holding(tokens: int, n: int, per_batch: int) -> int:  # of n batches, the first that hold tokens (0: all)
    return n if not tokens else min(n, -(-tokens // per_batch))


def _first_tokens(inputs: BlockInputs, tokens: int) -> BlockInputs:
    """The first batches of ``inputs`` that hold at least ``tokens`` tokens (all of them for 0)."""
    n = len(inputs.hidden)
    return inputs.split(n - _batches_holding(tokens, n, inputs.hidden[0].shape[:2].numel()))[0]


def _carried_batches(run: Run, cfg: QuantizeConfig) -> list[Tensor]:
    """The calibration batches the blocks carry: with RTN rounding and ``observe_tokens`` a dense model's blocks read
    only the first fitting windows and the held-out ones (the same result). GPTQ, guided Hessians, experts read all."""
    if cfg.awq.rounding == "gptq" or cfg.gptq.guided or not cfg.awq.observe_tokens or run.experts is not None:
        return run.batches
    fit = run.fit_batches
    keep = _batches_holding(cfg.awq.observe_tokens, len(fit), fit[0].numel())  # what _first_tokens keeps
    log.info("awq carries the %d of %d fitting batches it reads, and %d held out", keep, len(fit), run.holdout)
    return fit[:keep] + run.held_batches


def _observe(block: nn.Module, linears: dict[str, nn.Linear], bmap: BlockMap, inputs: BlockInputs, n_tokens: int,
             seed: int, hessians: dict[str, gptq_solver.Hessian] | None, weights: dict[str, list[Tensor]] | None) -> Sampler:
    """Run the block once with hooks on its linears (and the modules that judge a scale)."""
    sampler = Sampler(inputs, n_tokens, seed, hessians, weights)
    handles = [m.register_forward_pre_hook(sampler.hook(n)) for n, m in linears.items()]
    handles += [block.get_submodule(sm.inspect).register_forward_pre_hook(sampler.module_hook(sm.inspect),
                                                                         with_kwargs=True)
                for sm in bmap.smooths if sm.inspect is not None]
    try:
        inputs.forward(block)
    finally:
        for h in handles:
            h.remove()
        sampler.release()
    return sampler


@torch.inference_mode()
def _group_error(block: nn.Module, sm: Smooth, sampler: Sampler, weights: list[Tensor],
                 autocast: torch.dtype | None = None) -> Callable[[list[Tensor]], float]:
    """The output error a smoothing scale is judged by, as a function of the group's weights: the linears' own
    concatenated outputs on the sampled rows, or the ``inspect`` module's (e.g. attention, the MLP) on whole sampled
    batches, its forwards under ``autocast`` (``search_dtype``) where given."""
    if sm.inspect is None:
        return linear_error(sampler.x(sm.linears[0]), weights, autocast)
    inspect = block.get_submodule(sm.inspect)
    names = [f"{n[len(sm.inspect) + 1:]}.weight" for n in sm.linears]
    batches = sampler.module_inputs[sm.inspect]

    def forward(ws):
        outs = []
        with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            for h, kw in batches:
                out = functional_call(inspect, dict(zip(names, ws)), (h,), kw)
                outs.append(out[0] if isinstance(out, tuple) else out)
        return torch.cat(outs)
    return output_error(forward, forward([w.float() for w in weights]))


def _scale_prev(prev: nn.Module, s: Tensor, norm_offset: float) -> None:
    if isinstance(prev, nn.Linear):  # a linear feeding the group: divide its output rows
        prev.weight.data.div_(s[:, None].to(prev.weight.dtype))
        if prev.bias is not None:
            prev.bias.data.div_(s.to(prev.bias.dtype))
    else:  # a norm: (offset + w) / s
        w = prev.weight.data
        w.copy_(((norm_offset + w.float()) / s - norm_offset).to(w.dtype))


@dataclass
class _Judge:
    """The held-out side of one block's AWQ (compress/methods/common/fallback.py): what each linear is judged by on the
    held-out windows (observed on the fp block), the weights already rounded while judging a group (reused at the
    end unless a later group rescales that linear's rows), the linears judged with a group, and those that fell back
    to plain RTN."""

    held: dict[str, fallback.Gram | fallback.Rows]
    prefix: str
    rounded: dict[str, Rounded] = field(default_factory=dict)
    grouped: set[str] = field(default_factory=set)
    plain: set[str] = field(default_factory=set)


@dataclass
class _Snapshot:
    """What folding a group's scale changes (the feeding op, the linears, their sampled inputs and Hessians), kept
    to put back exactly when the group falls back to RTN."""

    params: list[tuple[Tensor, Tensor]]  # (live tensor, its copy)
    samples: dict[str, list[Tensor]]
    weights: list[Tensor]  # the group's linears' weights before the fold (copies)

    @classmethod
    def take(cls, prev: nn.Module, mods: list[nn.Module], names: tuple[str, ...], sampler: Sampler,
             hessians: dict[str, gptq_solver.Hessian] | None) -> "_Snapshot":
        live = [prev.weight.data] + ([prev.bias.data] if getattr(prev, "bias", None) is not None else [])
        if hessians is not None:
            live += list({id(hessians[n]): hessians[n].H for n in names}.values())
        weights = [m.weight.data.clone() for m in mods]
        params = [(t, t.clone()) for t in live] + [(m.weight.data, w) for m, w in zip(mods, weights)]
        return cls(params, {n: sampler.samples[n] for n in names}, weights)

    def restore(self, sampler: Sampler) -> None:
        for t, copy in self.params:
            t.copy_(copy)
        sampler.samples.update(self.samples)


def _smooth(i: int, block: nn.Module, sm: Smooth, linears: dict[str, nn.Linear], sampler: Sampler, cfg: QuantizeConfig,
            bmap: BlockMap, hessians: dict[str, gptq_solver.Hessian] | None,
            judge: _Judge | None = None) -> SmoothRecord | None:
    """Search block ``i``'s group's scale and fold it in (the feeding op / s, the linears' columns * s, their sampled
    inputs and Hessian likewise); None where the group does not apply to this block. With a ``judge``, the group's
    linears are clipped and rounded at once and the fold undone where plain RTN of the unscaled weights has the
    smaller output error on the held-out windows."""
    if not all(n in linears for n in sm.linears):
        return None
    prev = block.get_submodule(sm.prev)
    mods = [linears[n] for n in sm.linears]
    if any(m.in_features != prev.weight.shape[0] for m in mods):  # e.g. v_proj -> o_proj under GQA
        return None
    weights = [m.weight.data for m in mods]
    error = _group_error(block, sm, sampler, weights, autocast_of(cfg.awq.search_dtype))
    res = search_scale(sampler.x_mean(sm.linears[0]), weights, cfg.scheme, error, cfg.awq.grid, cfg.awq.duo_scaling,
                       cfg.awq.coarse)
    s = res.scales
    snapshot = None if judge is None else _Snapshot.take(prev, mods, sm.linears, sampler, hessians)
    _scale_prev(prev, s, bmap.norm_offset)
    for n, m in zip(sm.linears, mods):
        m.weight.data.mul_(s.to(m.weight.dtype))
        sampler.samples[n] = [torch.cat(sampler.samples[n]) / s]
    if hessians is not None:  # the inputs are now x / s: H -> H / (s s^T), once per distinct Hessian
        for h in {id(hessians[n]): hessians[n] for n in sm.linears}.values():
            h.H.div_(torch.outer(s, s))
    record = SmoothRecord(i, sm.prev, res.ratio, res.loss, res.base_loss)
    if judge is not None:
        record = _judge_group(record, sm, mods, s, sampler, cfg, bmap, hessians, judge, snapshot)
    return record


def _judge_group(record: SmoothRecord, sm: Smooth, mods: list[nn.Module], s: Tensor, sampler: Sampler,
                 cfg: QuantizeConfig, bmap: BlockMap, hessians: dict[str, gptq_solver.Hessian] | None, judge: _Judge,
                 snapshot: _Snapshot) -> SmoothRecord:
    """The group's scaled, clipped, rounded weights (unscaled: ``/ s``) against RTN of its original weights on the
    held-out windows; falls back (undoing the fold) where RTN's summed error is smaller. Returns ``record`` judged."""
    choices = []
    for n, m, w0 in zip(sm.linears, mods, snapshot.weights):
        judge.rounded[n] = round_weight(m.weight.data, sampler.x(n), None if hessians is None else hessians[n].H, cfg,
                                        cfg.awq.clip and n not in bmap.no_clip)
        plain = quantize_weight(w0, cfg.scheme)
        choices.append(fallback.compare(w0, judge.rounded[n].weight.dequantize() / s, plain.dequantize(),
                                        judge.held[n]))
    choice = fallback.combine(choices)
    clip = sum(judge.rounded[n].clip for n in sm.linears) / len(sm.linears)  # the AWQ candidate's, for the record
    judge.grouped.update(sm.linears)
    if choice.rtn:
        snapshot.restore(sampler)
        judge.plain.update(sm.linears)
        for n in sm.linears:
            judge.rounded.pop(n)
    else:
        judge.rounded.pop(sm.prev, None)  # its rows were rescaled: rounded again at the end
    return dataclasses.replace(record, judged=choice.judgement(), clip=clip,
                               names=[f"{judge.prefix}{n}" for n in sm.linears])


def quantize_expert(w_gu: Tensor, w_down: Tensor, x: Tensor, act, cfg: QuantizeConfig) -> ExpertResult:
    """AWQ of one MoE expert on its routed tokens ``x [n, H]``: scale search between up and down (the only op
    private to the expert; the norm before gate/up is shared with the router and every other expert), then
    the same clipping and rounding as a dense linear (:func:`round_weight`)."""
    scheme, opts = cfg.scheme, cfg.awq
    w_gu, w_down = w_gu.float().clone(), w_down.float().clone()
    inter_all = intermediate(x, w_gu, act)  # [n, I]
    h_gu = h_dn = None
    if opts.rounding == "gptq":  # GPTQ's Hessians over every routed token, as the dense path's
        h_gu, h_dn = (gptq_solver.Hessian.zeros(n, product_of(cfg.gptq)) for n in (x.shape[1], inter_all.shape[1]))
        h_gu.add(x)
        h_dn.add(inter_all)
    rows = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(cfg.seed))[:opts.search_tokens]
    x, inter = x[rows], inter_all[rows]  # a fixed sample of the routed tokens for the searches
    res = search_scale(inter_all.abs().mean(0), [w_down], scheme, linear_error(inter, [w_down]), opts.grid,
                       opts.duo_scaling, opts.coarse)
    s = res.scales  # [I]: up rows / s, down columns * s leaves the fp expert unchanged
    n_i = w_down.shape[1]
    w_gu[n_i:] /= s[:, None]
    w_down *= s
    inter = inter / s
    if h_dn is not None:
        h_dn.H.div_(torch.outer(s, s))
    gu, gu_loss, _ = round_weight(w_gu, x, None if h_gu is None else h_gu.H, cfg, opts.clip)
    dn, dn_loss, _ = round_weight(w_down, inter, None if h_dn is None else h_dn.H, cfg, opts.clip)
    losses = {"down_proj": res.loss, "down_proj_rtn": res.base_loss}
    if gu_loss is not None:
        losses.update(gate_up_proj_gptq=gu_loss, down_proj_gptq=dn_loss)
    return ExpertResult(gu, dn, losses)


def _final_weight(name: str, lin: nn.Linear, sampler: Sampler, hessians: dict[str, gptq_solver.Hessian] | None,
                  cfg: QuantizeConfig, bmap: BlockMap, judge: _Judge | None, records: list[Record], i: int
                  ) -> Rounded:
    """One linear's last step: plain RTN where its group fell back, the weight rounded while judging its group, or
    clipped and rounded now (a linear in no group judged alone against RTN, a record appended to ``records``)."""
    if judge is not None and name in judge.plain:
        return Rounded(quantize_weight(lin.weight.data, cfg.scheme), None)
    if judge is not None and name in judge.rounded:
        return judge.rounded.pop(name)
    res = round_weight(lin.weight.data, sampler.x(name), None if hessians is None else hessians[name].H, cfg,
                       cfg.awq.clip and name not in bmap.no_clip)
    if judge is None or name in judge.grouped:
        return res
    plain = quantize_weight(lin.weight.data, cfg.scheme)
    choice = fallback.compare(lin.weight.data, res.weight.dequantize(), plain.dequantize(), judge.held[name])
    judged = choice.judgement()
    records.append(LayerRecord(i, name, judged=judged, clip=res.clip, names=[f"{judge.prefix}{name}"]))
    log.info("%s%s: clip %.3f, held-out error awq (no scale) %.4g, rtn %.4g -> %s", judge.prefix, name, res.clip,
             judged.heldout_error, judged.rtn_heldout_error, judged.choice)
    return Rounded(plain, None) if choice.rtn else res


def _log_group(record: SmoothRecord) -> None:
    judged = record.judged
    if judged is not None:
        log.info("block %d %s -> %s: scale ratio %.2f, clip %.3f, held-out error awq %.4g, rtn %.4g -> %s",
                 record.layer, record.smooth, ", ".join(record.names), record.ratio, record.clip, judged.heldout_error,
                 judged.rtn_heldout_error, judged.choice)


def quantize(model: nn.Module, cfg: QuantizeConfig, run: Run) -> None:
    """AWQ, block by block on the previous blocks' quantized outputs: sample, smooth each group of the
    model's map, then clip and round each linear; then each block's MoE experts. With held-out batches
    (``run.holdout``), AWQ searches on the others and each group (each linear in no group) keeps plain RTN of its
    unscaled weights where that is better on them (the experts, not judged, fit on every batch)."""
    bmap = block_map(model.config.model_type)
    prefix = layers_name(model)
    tw = guided.token_weights(model, run.fit_batches, cfg.ignore, cfg.gptq.guided_mix,
                                 cfg.gptq.guided_nsamples) if cfg.gptq.guided else None

    def per_block(i: int, block: nn.Module, inputs: BlockInputs) -> None:
        linears = target_linears(block, cfg.ignore, f"{prefix}.{i}.")
        fit, held = inputs.split(run.holdout)
        product = autocast_of(cfg.awq.search_dtype) or torch.float32  # the held-out judges' products
        judge = None if held is None else _Judge(gptq_solver.observe_held(block, linears, held, product=product),
                                                 f"{prefix}.{i}.")
        hessians = (_shared_hessians(linears, bmap, tw is not None, product_of(cfg.gptq))
                    if cfg.awq.rounding == "gptq" else None)
        observed = fit if hessians is not None else _first_tokens(fit, cfg.awq.observe_tokens)
        sampler = _observe(block, linears, bmap, observed, cfg.awq.search_tokens, cfg.seed + i, hessians,
                           None if tw is None else {n: tw.pop((i, n)) for n in linears})
        for sm in bmap.smooths:
            record = _smooth(i, block, sm, linears, sampler, cfg, bmap, hessians, judge)
            if record is not None:
                run.report.layers.append(record)
                _log_group(record)
        for name, lin in linears.items():
            qw, loss, _ = _final_weight(name, lin, sampler, hessians, cfg, bmap, judge, run.report.layers, i)
            if loss is not None:
                run.report.layers.append(LayerRecord(i, name, loss))
            swap_linear(block, name, lin, qw)
        if run.experts is not None:
            run.report.layers.extend(run.experts(i, block, inputs, partial(quantize_expert, cfg=cfg)))
    run_sequential(model, _carried_batches(run, cfg), per_block, run.progress, autocast_of(cfg.calib_dtype),
                   run.store)
