"""Quantize a model in place: check the config fits the model, run the steps every method shares
(rotation, KV-head conversion), then the method itself, looked up in one dict. Each method's code,
its hooks included, lives in its own file behind one signature: ``quantize(model, cfg, run)``."""
from __future__ import annotations

import copy
import time
from torch import Tensor, nn

from compress.calibrate import IN_MEMORY, BlockStore, Method, Progress, QuantizeReport, Run, TrainProgress, layers_name
from compress.config import QuantizeConfig
from compress.methods import awq, gptq, nf4, qat, rtn
from compress.methods.common import fallback, moe
from compress.methods.common.report import FitNote, GQANote, UptrainNote
from compress.transforms import gqa, rotate

__all__ = ["METHODS", "Progress", "QuantizeReport", "TrainProgress", "quantize_model"]

# every method behind one signature; int8 is rtn with bits: 8, AWQ with GPTQ rounding is awq with rounding: gptq
METHODS: dict[str, Method] = {  # the names compress/config.py accepts (METHODS), in its order
    "rtn": rtn.quantize,
    "gptq": gptq.quantize,
    "awq": awq.quantize,
    "nf4": nf4.quantize,
    "qat": qat.quantize,
}

FALLBACK_METHODS = ("gptq", "awq")  # the methods that keep RTN where it is better on held-out windows


def _convert_kv_heads(model: nn.Module, cfg: QuantizeConfig, batches, report: QuantizeReport,
                      progress: Progress | None, train_progress: TrainProgress | None) -> nn.Module | None:
    """GQA conversion (+ layer-wise fitting, reported per layer on ``progress``, + uptraining); returns the
    original model when a later step distils from it."""
    trains = cfg.uptrain_steps or cfg.kv_fit_steps or cfg.method == "qat"
    teacher = copy.deepcopy(model) if trains else None
    res = gqa.convert_and_uptrain(model, cfg.kv_heads, batches, cfg.uptrain_steps, cfg.uptrain_lr, teacher,
                                  cfg.batch_size, cfg.train_dtype, cfg.seed, train_progress, cfg.kv_init,
                                  cfg.uptrain_scope, cfg.kv_fit_steps, cfg.kv_fit_lr,
                                  None if progress is None else lambda layer, layers, *_: progress(layer, layers))
    fit, up = res.fit, res.uptrain
    report.notes.gqa = GQANote(res.kv, None if fit is None else FitNote(fit.mean_before, fit.mean_after, fit.seconds),
                               None if up is None else UptrainNote(up.first, up.last, up.seconds))
    return teacher if cfg.method == "qat" else None


def quantize_model(model: nn.Module, cfg: QuantizeConfig, batches: list[Tensor] | None = None,
                   progress: Progress | None = None, train_progress: TrainProgress | None = None,
                   store: BlockStore = IN_MEMORY) -> QuantizeReport:
    """Quantize ``model`` in place with ``cfg``; ``batches`` of token ids are needed by gptq/awq/qat and
    uptraining. With ``cfg.kv_heads`` the KV heads are pooled (and uptrained) first; MoE experts are
    quantized per expert by the method (compress/methods/common/moe.py). ``store`` streams the blocks in and out
    (compress/stream.py) for the layer-by-layer methods."""
    report = QuantizeReport(cfg.method)
    t0 = time.perf_counter()
    layout = moe.expert_layout(model, cfg)  # checks MoE options before any work
    if cfg.needs_calibration and not batches:
        raise ValueError(f"method {cfg.method}" + (" with uptrain_steps" if cfg.uptrain_steps else "")
                         + " needs calibration data; give --calib (e.g. wiki)")
    if cfg.rotate != "none":  # before any method: the same fp function, its outliers spread over all channels
        report.notes.rotate = rotate.rotate_model(model, cfg.rotate, cfg.seed)
    teacher = _convert_kv_heads(model, cfg, batches, report, progress, train_progress) if cfg.kv_heads else None
    experts = None if layout is None else moe.BlockExperts(layout, cfg, layers_name(model))
    held = 0
    if cfg.fallback and cfg.method in FALLBACK_METHODS and batches:
        split = fallback.split_windows(batches, cfg.holdout)
        batches, held = split.fit + split.held, len(split.held)
    ptq = METHODS[cfg.qat.init] if cfg.method == "qat" and cfg.qat.init != "rtn" else None  # QAT's PTQ init
    run = Run(report, batches, progress, train_progress, store, experts, teacher, holdout=held, ptq=ptq)
    METHODS[cfg.method](model, cfg, run)
    if held:
        report.notes.fallback = fallback.summary(report.decisions(), sum(b.shape[0] for b in run.held_batches))
    report.seconds = time.perf_counter() - t0
    return report
