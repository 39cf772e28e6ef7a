"""Quantize a model in place: pick the linears, dispatch to the method, swap in packed QuantLinears."""
from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from compress import awq, gptq, nf4, rotate, rtn
from compress.calibrate import IN_MEMORY, BlockInputs, BlockStore, decoder_layers, run_sequential
from compress.checkpoint import set_module
from compress.config import QuantizeConfig
from compress.mappings import KEEP_FP, BlockMap, block_map
from compress.qlinear import QuantLinear
from compress.quant import QuantizedWeight, Scheme

log = logging.getLogger(__name__)
Progress = Callable[[int, int], None]
TrainProgress = Callable[[int, int, float], None]  # (step, steps, loss) of QAT / uptraining


@dataclass
class QuantizeReport:
    method: str
    seconds: float = 0.0
    layers: list[dict] = field(default_factory=list)  # one entry per quantized linear or AWQ smoothing
    notes: dict = field(default_factory=dict)  # "gqa": KV heads and bytes/token, "qat": training losses


def target_linears(block: nn.Module, ignore: tuple[str, ...], prefix: str = "") -> dict[str, nn.Linear]:
    """The block's ``nn.Linear`` layers to quantize (relative names), minus routers and ``ignore``."""
    pats = [re.compile(p) for p in (*KEEP_FP, *ignore)]
    return {n: m for n, m in block.named_modules()
            if isinstance(m, nn.Linear) and not any(p.search(f"{prefix}{n}") for p in pats)}


def _swap(block: nn.Module, name: str, lin: nn.Linear, qw: QuantizedWeight) -> None:
    set_module(block, name, QuantLinear.from_quantized(qw, lin.bias, dtype=lin.weight.dtype))


def _data_free(scheme: Scheme) -> Callable[[Tensor], QuantizedWeight]:
    if scheme.format == "nf4":
        return lambda w: nf4.quantize_weight(w, scheme.group_size)
    return lambda w: rtn.quantize_weight(w, scheme)


def quantize_data_free(model: nn.Module, cfg: QuantizeConfig, report: QuantizeReport,
                       progress: Progress | None = None, layout=None, store: BlockStore = IN_MEMORY) -> None:
    """RTN / NF4 / INT8: each block's linears (and MoE experts, by ``layout``) from their weights alone."""
    from compress import moe

    layers = decoder_layers(model)
    fn = _data_free(cfg.scheme)
    for i, block in enumerate(layers):
        store.load(i, block)
        for name, lin in target_linears(block, cfg.ignore).items():
            _swap(block, name, lin, fn(lin.weight.data))
        if layout is not None:
            report.layers.extend(moe.quantize_block_experts(i, block, layout, cfg))
        store.release(i, block)
        if progress:
            progress(i + 1, len(layers))


def _gptq_block(cfg: QuantizeConfig, report: QuantizeReport):
    def per_block(i: int, block: nn.Module, inputs: BlockInputs) -> None:
        linears = target_linears(block, cfg.ignore)
        hessians = {n: gptq.Hessian.zeros(m.in_features) for n, m in linears.items()}
        owner: dict[str, str] = {}  # linears fed the very same tensor (q/k/v) share one Hessian
        first_batch: dict[int, tuple[str, Tensor]] = {}  # holds the tensors so addresses stay unique

        def hook(name):
            def fn(module, args):
                x = args[0]
                if name not in owner:
                    rep = first_batch.get(x.data_ptr())
                    owner[name] = rep[0] if rep is not None and rep[1] is x else name
                    first_batch.setdefault(x.data_ptr(), (name, x))
                if owner[name] == name:
                    hessians[name].add(x)
            return fn

        handles = [m.register_forward_pre_hook(hook(n)) for n, m in linears.items()]
        try:
            inputs.forward(block)
        finally:
            for h in handles:
                h.remove()
        first_batch.clear()
        for name, lin in linears.items():
            res = gptq.quantize_weight(lin.weight.data, hessians[owner[name]].H, cfg.scheme, cfg.damp, cfg.block_size,
                                       cfg.act_order, cfg.static_groups, cfg.mse, cfg.weighted_range)
            report.layers.append({"layer": i, "name": name, "loss": res.loss})
            _swap(block, name, lin, res.weight)
    return per_block


class _Sampler:
    """Collects, per linear, the mean |x| over all tokens and a fixed random sample of token rows."""

    def __init__(self, inputs: BlockInputs, n_tokens: int, seed: int,
                 hessians: dict[str, "gptq.Hessian"] | None = None):
        gen = torch.Generator().manual_seed(seed)
        # optional: the GPTQ Hessian of every input, accumulated over all tokens (linears that share an
        # input share one object, which only the first of them updates)
        self.hessians = hessians or {}
        self._owner = {}
        for name, h in self.hessians.items():
            self._owner.setdefault(id(h), name)
        per_batch = max(1, n_tokens // len(inputs.hidden))
        self.rows = [torch.randperm(h.shape[0] * h.shape[1], generator=gen)[:per_batch] for h in inputs.hidden]
        self.abs_sum: dict[str, Tensor] = {}
        self.count: dict[str, int] = {}
        self.samples: dict[str, list[Tensor]] = {}
        # whole batches entering the modules that judge a scale (attention needs full sequences)
        tokens_per_batch = inputs.hidden[0].shape[0] * inputs.hidden[0].shape[1]
        self.n_batches = max(1, min(len(inputs.hidden), -(-n_tokens // tokens_per_batch)))
        self.module_inputs: dict[str, list[tuple[Tensor, dict]]] = {}

    def module_hook(self, name: str):
        def fn(module, args, kwargs):
            calls = self.module_inputs.setdefault(name, [])
            if len(calls) < self.n_batches:
                kwargs = dict(kwargs)
                hidden = args[0] if args else kwargs.pop("hidden_states")
                calls.append((hidden.float(), {k: v for k, v in kwargs.items()
                                               if k not in ("past_key_values", "past_key_value", "use_cache")}))
        return fn

    def hook(self, name: str):
        def fn(module, args):
            x = args[0].reshape(-1, args[0].shape[-1]).float()
            h = self.hessians.get(name)
            if h is not None and self._owner[id(h)] == name:
                h.add(x)
            calls = self.samples.setdefault(name, [])
            self.abs_sum[name] = self.abs_sum.get(name, 0) + x.abs().sum(0)
            self.count[name] = self.count.get(name, 0) + x.shape[0]
            calls.append(x[self.rows[len(calls)]])
        return fn

    def x_mean(self, name: str) -> Tensor:
        return self.abs_sum[name] / self.count[name]

    def x(self, name: str) -> Tensor:
        return torch.cat(self.samples[name])


def _scale_prev(prev: nn.Module, s: Tensor, norm_offset: float) -> None:
    if isinstance(prev, nn.Linear):  # a linear feeding the group: divide its output rows
        prev.weight.data.div_(s[:, None].to(prev.weight.dtype))
        if prev.bias is not None:
            prev.bias.data.div_(s.to(prev.bias.dtype))
    else:  # a norm: (offset + w) / s
        w = prev.weight.data
        w.copy_(((norm_offset + w.float()) / s - norm_offset).to(w.dtype))


def _awq_block(cfg: QuantizeConfig, bmap: BlockMap, report: QuantizeReport):
    from torch.func import functional_call

    def per_block(i: int, block: nn.Module, inputs: BlockInputs) -> None:
        linears = target_linears(block, cfg.ignore)
        hessians = _shared_hessians(linears, bmap) if cfg.rounding == "gptq" else None
        sampler = _Sampler(inputs, cfg.search_tokens, cfg.seed + i, hessians)
        handles = [m.register_forward_pre_hook(sampler.hook(n)) for n, m in linears.items()]
        handles += [block.get_submodule(sm.inspect).register_forward_pre_hook(sampler.module_hook(sm.inspect),
                                                                             with_kwargs=True)
                    for sm in bmap.smooths if sm.inspect is not None]
        try:
            inputs.forward(block)
        finally:
            for h in handles:
                h.remove()
        scheme = cfg.scheme
        for sm in bmap.smooths:
            if not all(n in linears for n in sm.linears):
                continue
            prev = block.get_submodule(sm.prev)
            mods = [linears[n] for n in sm.linears]
            width = prev.weight.shape[0]
            if any(m.in_features != width for m in mods):  # e.g. v_proj -> o_proj under GQA
                continue
            x = sampler.x(sm.linears[0])
            if sm.inspect is None:
                def forward(ws, x=x):
                    return torch.cat([x @ w.T for w in ws], dim=-1)
            else:
                inspect = block.get_submodule(sm.inspect)
                names = [f"{n[len(sm.inspect) + 1:]}.weight" for n in sm.linears]
                batches = sampler.module_inputs[sm.inspect]

                def forward(ws, inspect=inspect, names=names, batches=batches):
                    outs = []
                    for h, kw in batches:
                        out = functional_call(inspect, dict(zip(names, ws)), (h,), kw)
                        outs.append(out[0] if isinstance(out, tuple) else out)
                    return torch.cat(outs)
            with torch.inference_mode():
                ref = forward([m.weight.data.float() for m in mods])
            res = awq.search_scale(sampler.x_mean(sm.linears[0]), [m.weight.data for m in mods], scheme, forward,
                                   ref, cfg.grid, cfg.duo_scaling)
            s = res.scales
            _scale_prev(prev, s, bmap.norm_offset)
            for n, m in zip(sm.linears, mods):
                m.weight.data.mul_(s.to(m.weight.dtype))
                sampler.samples[n] = [torch.cat(sampler.samples[n]) / s]
            if hessians is not None:  # the inputs are now x / s: H -> H / (s s^T), once per shared Hessian
                hessians[sm.linears[0]].H.div_(torch.outer(s, s))
            report.layers.append({"layer": i, "smooth": sm.prev, "ratio": res.ratio, "loss": res.loss,
                                  "rtn_loss": res.base_loss})
        for name, lin in linears.items():
            w = lin.weight.data
            if cfg.clip and name not in bmap.no_clip:
                bound = awq.search_clip(sampler.x(name)[:cfg.clip_tokens], w, scheme, cfg.clip_grid)
                w = awq.clip_weight(w, bound, scheme)
            if hessians is None:
                energy = sampler.x(name).pow(2).mean(0) if cfg.weighted_range else None
                _swap(block, name, lin, rtn.quantize_weight(w, scheme, energy))
                continue
            res = gptq.quantize_weight(w, hessians[name].H, scheme, cfg.damp, cfg.block_size, cfg.act_order,
                                       cfg.static_groups, cfg.mse, cfg.weighted_range)
            report.layers.append({"layer": i, "name": name, "loss": res.loss})
            _swap(block, name, lin, res.weight)
    return per_block


def _shared_hessians(linears: dict[str, nn.Module], bmap: BlockMap) -> dict[str, gptq.Hessian]:
    """One GPTQ Hessian per distinct input: the linears a norm smooths together read the same tensor."""
    out: dict[str, gptq.Hessian] = {}
    for sm in bmap.smooths:
        if all(n in linears for n in sm.linears):
            h = gptq.Hessian.zeros(linears[sm.linears[0]].in_features)
            out.update({n: h for n in sm.linears})
    for name, lin in linears.items():
        if name not in out:
            out[name] = gptq.Hessian.zeros(lin.in_features)
    return out


def _with_experts(per_block, layout, cfg: QuantizeConfig, report: QuantizeReport):
    """After the block's linears, quantize its MoE experts on their routed tokens (compress/moe.py)."""
    from compress import moe

    def fn(i: int, block: nn.Module, inputs: BlockInputs) -> None:
        per_block(i, block, inputs)
        report.layers.extend(moe.quantize_block_experts(i, block, layout, cfg, inputs))
    return fn


def _convert_kv_heads(model: nn.Module, cfg: QuantizeConfig, batches, report: QuantizeReport,
                      progress: Progress | None, train_progress: TrainProgress | None) -> nn.Module | None:
    """GQA conversion (+ layer-wise fitting, reported per layer on ``progress``, + uptraining); returns the
    original model when a later step distils from it."""
    import copy
    from dataclasses import asdict

    from compress import gqa

    trains = cfg.uptrain_steps or cfg.kv_fit_steps or cfg.method == "qat"
    teacher = copy.deepcopy(model) if trains else None
    res = gqa.convert_and_uptrain(model, cfg.kv_heads, batches, cfg.uptrain_steps, cfg.uptrain_lr, teacher,
                                  cfg.batch_size, cfg.train_dtype, cfg.seed, train_progress, cfg.kv_init,
                                  cfg.uptrain_scope, cfg.kv_fit_steps, cfg.kv_fit_lr,
                                  None if progress is None else lambda layer, layers, *_: progress(layer, layers))
    report.notes["gqa"] = {k: v for k, v in asdict(res).items() if k not in ("uptrain", "fit")}
    if res.fit is not None:
        report.notes["gqa"].update(fit_error_before=res.fit.mean_before, fit_error_after=res.fit.mean_after,
                                   fit_seconds=res.fit.seconds)
    if res.uptrain is not None:
        report.notes["gqa"].update(uptrain_loss_first=res.uptrain.first, uptrain_loss_last=res.uptrain.last,
                                   uptrain_seconds=res.uptrain.seconds)
    return teacher if cfg.method == "qat" else None


def quantize_model(model: nn.Module, cfg: QuantizeConfig, batches: list[Tensor] | None = None,
                   progress: Progress | None = None, train_progress: TrainProgress | None = None,
                   store: BlockStore = IN_MEMORY) -> QuantizeReport:
    """Quantize ``model`` in place with ``cfg``; ``batches`` of token ids are needed by gptq/awq/qat and
    uptraining. With ``cfg.kv_heads`` the KV heads are pooled (and uptrained) first; MoE experts are
    quantized per expert (compress/moe.py). ``store`` streams the blocks in and out (compress/stream.py)
    for the layer-by-layer methods."""
    from compress import moe

    report = QuantizeReport(cfg.method)
    t0 = time.perf_counter()
    layout = moe.expert_layout(model, cfg)  # checks MoE options before any work
    if cfg.needs_calibration and not batches:
        raise ValueError(f"method {cfg.method}" + (" with uptrain_steps" if cfg.uptrain_steps else "")
                         + " needs calibration data; give --calib (e.g. wiki)")
    if cfg.rotate != "none":  # before any method: the same fp function, its outliers spread over all channels
        report.notes["rotate"] = vars(rotate.rotate_model(model, cfg.rotate, cfg.seed))
    teacher = _convert_kv_heads(model, cfg, batches, report, progress, train_progress) if cfg.kv_heads else None
    if cfg.method == "qat":
        from compress import qat

        res = qat.quantize(model, cfg, batches, teacher, progress, train_progress)
        report.notes["qat"] = {"init": res.init, "modules": res.modules, "steps": len(res.train.losses),
                               "loss_first": res.train.first, "loss_last": res.train.last,
                               "train_seconds": res.train.seconds}
    elif cfg.method in ("gptq", "awq"):
        if cfg.method == "gptq":
            per_block = _gptq_block(cfg, report)
        else:
            per_block = _awq_block(cfg, block_map(model.config.model_type), report)
        if layout is not None:
            per_block = _with_experts(per_block, layout, cfg, report)
        autocast = torch.bfloat16 if cfg.calib_dtype == "bfloat16" else None
        run_sequential(model, batches, per_block, progress, autocast, store)
    else:
        quantize_data_free(model, cfg, report, progress, layout, store)
    report.seconds = time.perf_counter() - t0
    return report
