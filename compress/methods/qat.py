"""Quantization-aware training (LSQ, Esser et al., 2020): every target linear computes its forward
with fake-quantized weights ``(clamp(round(w / s) + z, 0, maxq) - z) * s``, rounding passed straight
through (STE) so both the latent weights ``w`` and the group scales ``s`` learn. Scales are learned in
log space (a step changes them by a relative amount, whatever their size) and always used rounded
to fp16, the precision the checkpoint stores. Zeros stay fixed at their PTQ value unless
``learn_zero`` (then they are rounded with an STE too).

Training starts from a PTQ result (RTN; AWQ's smoothed weights and clipped qparams; or GPTQ's) and distils
the fp teacher's logits (compress/train.py). :func:`freeze` turns each fake-quantized linear into
the same packed :class:`QuantLinear` as PTQ writes, whose dequantized weight equals the trained
fake-quantized weight exactly.
"""
from __future__ import annotations

import copy
import logging
import time
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from compress.calibrate import Method, Progress, QuantizeReport, Run, decoder_layers, layers_name, target_linears
from compress.config import QuantizeConfig
from compress.format import quant
from compress.format.checkpoint import set_module
from compress.format.qlinear import QuantLinear
from compress.format.quant import MIN_SCALE, QuantizedWeight, Scheme, compute_qparams, group_index
from compress.methods.common import selfdata
from compress.methods.common.report import QATNote
from compress.train import TrainConfig, TrainProgress, TrainResult, distill

log = logging.getLogger(__name__)

PTQ_INIT_TOKENS = 128 * 512  # the PTQ init's calibration budget (recipes/awq4.yaml's); QAT may train on more


def round_ste(x: Tensor) -> Tensor:
    """``round(x)`` in the forward pass, identity in the backward pass (the value is exactly round(x))."""
    return x + (torch.round(x) - x).detach()


def per_column(t: Tensor, in_features: int, scheme: Scheme) -> Tensor:
    """[out, G] -> [out, in]: each group's value on its columns (groups of consecutive columns)."""
    return t.index_select(1, group_index(in_features, scheme, t.device))


class _FakeQuant(torch.autograd.Function):
    """``(clamp(round(w / s) + z, 0, maxq) - z) * s`` on grouped ``w [out, G, g]``, ``s``/``z`` ``[out, G, 1]``,
    with LSQ's straight-through gradients in closed form: nothing but the inputs is saved, and the
    forward uses exactly compress.format.quant's operations (so it equals quantize + dequantize bit for bit).
    With ``unit`` ``[out, G, 1]`` the first input is the latent in grid steps and ``w = latent * unit`` is
    recomputed in the backward rather than kept."""

    @staticmethod
    def forward(ctx, latent: Tensor, s: Tensor, z: Tensor, maxq: int, unit: Tensor | None = None) -> Tensor:
        ctx.save_for_backward(latent, s, z, unit)
        ctx.maxq = maxq
        w = latent if unit is None else latent * unit
        return (w / s).round_().add_(z).clamp_(0, maxq).sub_(z).mul_(s)

    @staticmethod
    def backward(ctx, grad: Tensor):
        latent, s, z, unit = ctx.saved_tensors
        w = latent if unit is None else latent * unit
        x = w / s
        v = torch.round(x).add_(z)  # the code before clamping
        inside = (v >= 0) & (v <= ctx.maxq)
        grad_w = grad * inside  # STE: identity on the grid, zero where clamped
        if unit is not None:
            grad_w = grad_w.mul_(unit)
        # d out / d s: round(x) - x on the grid, (clamped code - z) outside it
        ds = torch.where(inside, v - z - x, v.clamp_(0, ctx.maxq) - z)
        grad_s = (grad * ds).sum(dim=-1, keepdim=True)
        grad_z = None
        if ctx.needs_input_grad[2]:  # d out / d z: 0 on the grid, -s outside it
            grad_z = (grad * ~inside).sum(dim=-1, keepdim=True).mul_(-s)
        return grad_w, grad_s, grad_z, None, None


class FakeQuantLinear(nn.Module):
    """A linear trained through its quantizer: latent fp32 weight (optionally in grid steps), learnable
    log-scales [out, G], fixed (or learnable) zeros [out, G]."""

    def __init__(self, weight: Tensor, bias: Tensor | None, scale: Tensor, zero: Tensor | None, scheme: Scheme,
                 learn_zero: bool = False, lr_in_steps: bool = False):
        super().__init__()
        if scheme.format != "int":
            raise ValueError(f"QAT trains integer grids; format={scheme.format!r} is not supported (use bits/sym)")
        self.scheme = scheme
        self.out_features, self.in_features = weight.shape
        self.dtype = weight.dtype
        # lr_in_steps: the trained parameter is the weight in units of its group's initial grid step, so that
        # Adam's step (about lr per weight) moves every weight the same share of a code, whatever its group's range
        self.unit = nn.Buffer(scale.detach().float().clamp(min=MIN_SCALE)) if lr_in_steps else None
        self.latent = nn.Parameter(torch.empty(weight.shape, dtype=torch.float32))
        self.set_weight(weight)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        self.log_scale = nn.Parameter(scale.detach().float().log())
        if scheme.has_zeros:
            z = zero.detach().float().clone()
            self.zero = nn.Parameter(z) if learn_zero else nn.Buffer(z)
        else:
            self.zero = None

    @property
    def weight(self) -> Tensor:
        """The latent fp32 weight [out, in], in the linear's own units (differentiable)."""
        return self.latent if self.unit is None else self.latent * per_column(self.unit, self.in_features, self.scheme)

    @torch.no_grad()
    def set_weight(self, w: Tensor) -> None:
        w = w.detach().float()
        self.latent.copy_(w if self.unit is None else w / per_column(self.unit, self.in_features, self.scheme))

    def qparams(self) -> tuple[Tensor, Tensor | float]:
        """Scale [out, G] (fp32 holding fp16 values) and zero ([out, G] integral floats, or the symmetric constant)."""
        s = self.log_scale.exp().clamp(min=MIN_SCALE)
        s = s + (s.half().float() - s).detach()  # use exactly what the checkpoint will store
        if self.zero is None:
            return s, float(self.scheme.sym_zero)
        z = self.zero
        return s, z + (torch.round(z).clamp(self.scheme.zero_floor, self.scheme.maxq) - z).detach()

    def fake_weight(self) -> Tensor:
        """``[out, in]`` quantize-dequantize of the latent weight, differentiable by STE (LSQ)."""
        s, z = self.qparams()
        out_f, in_f = self.latent.shape
        G, g = s.shape[1], self.scheme.group(in_f)
        w = self.latent
        if G * g != in_f:  # ragged last group: pad with zeros (their codes are dropped below)
            w = nn.functional.pad(w, (0, G * g - in_f))
        if not isinstance(z, Tensor):
            z = torch.full_like(s, z)
        unit = None if self.unit is None else self.unit[..., None]
        # w: [out, in] -> [out, G, g]; s, z, unit: [out, G] -> [out, G, 1]
        wq = _FakeQuant.apply(w.reshape(out_f, G, g), s[..., None], z[..., None], self.scheme.maxq, unit)
        return wq.reshape(out_f, G * g)[:, :in_f]

    def forward(self, x: Tensor) -> Tensor:
        w = self.fake_weight()
        return nn.functional.linear(x, w.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))

    @torch.no_grad()
    def quantized_weight(self) -> QuantizedWeight:
        scale = self.log_scale.exp().clamp(min=MIN_SCALE).half()
        zero = None
        if self.zero is not None:
            zero = torch.round(self.zero).clamp(self.scheme.zero_floor, self.scheme.maxq).to(torch.uint8)
        return QuantizedWeight(quant.quantize(self.weight, scale, zero, self.scheme), scale, zero, self.scheme)

    def freeze(self) -> QuantLinear:
        """The packed QuantLinear whose dequantized weight equals :meth:`fake_weight` exactly."""
        return QuantLinear.from_quantized(self.quantized_weight(), self.bias, dtype=self.dtype)

    def extra_repr(self) -> str:
        s = self.scheme
        return (f"in={self.in_features}, out={self.out_features}, bits={s.bits}, group={s.group_size}, "
                f"sym={s.sym}, learn_zero={isinstance(self.zero, nn.Parameter)}")


def _targets(model: nn.Module, ignore: tuple[str, ...]) -> dict[str, nn.Linear]:
    """Full names of the linears PTQ would quantize (the same selection as every method's)."""
    layers = decoder_layers(model)
    prefix = layers_name(model)
    out = {}
    for i, block in enumerate(layers):
        for name, lin in target_linears(block, ignore, f"{prefix}.{i}.").items():
            out[f"{prefix}.{i}.{name}"] = lin
    return out


def _snap(f: FakeQuantLinear, qw: QuantizedWeight) -> int:
    """Put the latent weights whose code differs from ``qw``'s (weights clipped just inside the grid's edge,
    ties, the rounding of a division by the unit) on qw's grid point, so that training starts from exactly
    that result; returns how many differed."""
    differ = f.quantized_weight().q != qw.q
    f.set_weight(torch.where(differ, qw.dequantize(), f.weight.detach()))
    return int(differ.sum())


def init_rtn(model: nn.Module, scheme: Scheme, ignore: tuple[str, ...], learn_zero: bool = False,
             lr_in_steps: bool = False) -> dict[str, FakeQuantLinear]:
    """Wrap every target linear with RTN qparams: the initial fake-quantized model equals RTN exactly."""
    fakes = {}
    for name, lin in _targets(model, ignore).items():
        w = lin.weight.data
        scale, zero = compute_qparams(w, scheme)
        fakes[name] = FakeQuantLinear(w, lin.bias, scale, zero, scheme, learn_zero, lr_in_steps)
        _snap(fakes[name], QuantizedWeight(quant.quantize(w.float(), scale, zero, scheme), scale, zero, scheme))
        set_module(model, name, fakes[name])
    return fakes


def _first_tokens(batches: list[Tensor], n_tokens: int) -> list[Tensor]:
    used, n = [], 0
    for b in batches:
        if n >= n_tokens:
            break
        used.append(b)
        n += b.numel()
    return used


def init_ptq(model: nn.Module, cfg: QuantizeConfig, batches: list[Tensor], ptq: Method, progress: Progress | None = None
             ) -> dict[str, FakeQuantLinear]:
    """Run ``ptq``, the adapter of the config's ``init`` method (AWQ or GPTQ, with the config's awq / gptq options;
    the pipeline hands it over: QAT imports no other method), on the first
    PTQ_INIT_TOKENS tokens, then wrap each result so that the initial fake-quantized model equals it exactly:
    qparams = the method's scales and zeros; latent weight, clamped to the grid's range = AWQ's smoothed fp weight,
    or each weight as GPTQ rounded it (after the error feedback of the columns before it), so that the latent
    weights keep how far each is from flipping its code, as training from fp weights does."""
    init = cfg.qat.init
    originals = _targets(model, cfg.ignore)  # AWQ scales these modules' weights in place, then swaps them out
    run = Run(QuantizeReport(init), _first_tokens(batches, PTQ_INIT_TOKENS), progress,
              latents={} if init == "gptq" else None)
    ptq(model, cfg, run)
    fakes, agree, total = {}, 0, 0
    for name, lin in originals.items():
        ql = model.get_submodule(name)
        assert isinstance(ql, QuantLinear), f"{init} left {name} unquantized"
        qw = ql.quantized_weight()
        if qw.g_idx is not None:  # config refuses act_order without static_groups for qat
            raise ValueError(f"{name}: QAT trains groups of consecutive columns; {init} made scattered ones")
        s = per_column(qw.scale.float(), lin.in_features, qw.scheme)
        z = float(qw.scheme.sym_zero) if qw.zero is None else per_column(qw.zero.float(), lin.in_features, qw.scheme)
        w = run.latents.pop(lin) if init == "gptq" else lin.weight.data.float()
        w = torch.clamp(w, (0 - z) * s, (qw.scheme.maxq - z) * s)
        f = FakeQuantLinear(w, ql.bias, qw.scale, qw.zero, qw.scheme, cfg.qat.learn_zero, cfg.qat.lr_in_steps)
        agree += qw.q.numel() - _snap(f, qw)
        total += qw.q.numel()
        fakes[name] = f
        set_module(model, name, f)
    # guards the coupling with the adapters (AWQ smooths the original linears in place, GPTQ fills run.latents):
    # codes must nearly agree
    if agree < 0.99 * total:
        raise RuntimeError(f"{init} init: only {agree / total:.1%} of codes match the {init} result; its adapter no "
                           "longer leaves the weights it rounded where compress/methods/qat.py reads them")
    return fakes


def freeze(model: nn.Module) -> int:
    """Replace every FakeQuantLinear by its packed QuantLinear; returns how many were frozen."""
    names = [n for n, m in model.named_modules() if isinstance(m, FakeQuantLinear)]
    for n in names:
        set_module(model, n, model.get_submodule(n).freeze())
    return len(names)


def with_self_data(ids: Tensor, teacher: nn.Module, share: float, seed: int,
                   progress: Progress | None = None) -> tuple[Tensor, float]:
    """``ids [n, seqlen]`` with its last ``round(share * n)`` windows replaced by windows the teacher samples
    (compress/methods/common/selfdata.py), and the seconds that took."""
    n_self = round(share * ids.shape[0])
    if n_self == 0:
        return ids, 0.0
    t0 = time.perf_counter()
    sampled = selfdata.sample_windows(teacher, n_self, ids.shape[1], seed=seed, progress=progress)
    seconds = time.perf_counter() - t0
    log.info("QAT: the fp model sampled %d of %d training windows in %.0f s", n_self, ids.shape[0], seconds)
    return torch.cat([ids[:ids.shape[0] - n_self], sampled]), seconds


@dataclass
class QATResult:
    train: TrainResult
    modules: int
    init: str
    self_data_seconds: float = 0.0  # sampling training windows from the teacher (QATOptions.self_data)


def trainable_groups(fakes: dict[str, FakeQuantLinear], lr: float, scale_lr: float) -> list[dict]:
    weights = [f.latent for f in fakes.values()]
    qparams = [f.log_scale for f in fakes.values()] + [f.zero for f in fakes.values()
                                                       if isinstance(f.zero, nn.Parameter)]
    return [{"params": weights, "lr": lr}, {"params": qparams, "lr": scale_lr}]


def train(model: nn.Module, cfg: QuantizeConfig, batches: list[Tensor], teacher: nn.Module | None = None,
          progress: Progress | None = None, train_progress: TrainProgress | None = None, ptq: Method | None = None
          ) -> QATResult:
    """QAT of ``model`` in place with a :class:`compress.config.QuantizeConfig` (method qat): PTQ init,
    distillation from ``teacher`` (default: a copy of ``model`` as given), then freeze to QuantLinears."""
    if not batches:
        raise ValueError("method qat needs calibration text to train on; give --calib (e.g. wiki)")
    if cfg.scheme.format != "int":
        raise ValueError(f"QAT trains integer grids; format {cfg.scheme.format!r} is not supported")
    ids = torch.cat(list(batches))  # [n, seqlen]
    if teacher is None:
        teacher = copy.deepcopy(model)
    for p in teacher.parameters():
        p.requires_grad_(False)
    opts = cfg.qat
    ids, self_seconds = with_self_data(ids, teacher, opts.self_data, cfg.seed, progress)
    if opts.init != "rtn":
        if ptq is None:
            raise ValueError(f"QAT with init: {opts.init} needs that method's adapter as ptq "
                             "(compress.pipeline.METHODS)")
        fakes = init_ptq(model, cfg, batches, ptq, progress)
    else:
        fakes = init_rtn(model, cfg.scheme, cfg.ignore, opts.learn_zero, opts.lr_in_steps)
    for p in model.parameters():
        p.requires_grad_(False)
    groups = trainable_groups(fakes, opts.lr, opts.scale_lr)
    for g in groups:
        for p in g["params"]:
            p.requires_grad_(True)
    tcfg = TrainConfig(steps=opts.steps, batch_size=cfg.batch_size, dtype=cfg.train_dtype, seed=cfg.seed)
    log.info("QAT: %d linears from %s, %d steps on %d windows of %d tokens", len(fakes), opts.init, opts.steps,
             ids.shape[0], ids.shape[1])
    try:
        result = distill(model, teacher, ids, [g for g in groups if g["params"]], tcfg, train_progress)
    finally:
        for p in model.parameters():
            p.requires_grad_(False)
    n = freeze(model)
    log.info("QAT: loss %.4f -> %.4f in %.0f s; froze %d linears", result.first, result.last, result.seconds, n)
    return QATResult(result, n, opts.init, self_seconds)


# -- the adapter ---------------------------------------------------------------------------------
def quantize(model: nn.Module, cfg: QuantizeConfig, run: Run) -> None:
    """QAT in place (:func:`train`), its losses in the report's notes."""
    res = train(model, cfg, run.batches, run.teacher, run.progress, run.train_progress, run.ptq)
    run.report.notes.qat = QATNote(res.init, res.modules, len(res.train.losses), res.train.first, res.train.last,
                                   res.train.seconds, res.self_data_seconds)
