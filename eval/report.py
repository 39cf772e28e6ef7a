"""Baseline vs compressed: perplexity, task accuracy and size of each model, side by side."""
from __future__ import annotations

import gc
import logging
import math
import time
from pathlib import Path

from torch import nn

from eval.progress import StepProgress, no_progress, quiet_third_party
from eval.result import Delta, EvalResult, ModelResult, Settings

log = logging.getLogger(__name__)

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")
SIZE_ON_DISK = "weight files on disk"
SIZE_GGUF = "fp32 parameters of the dequantized GGUF"


def model_size(src, model: nn.Module) -> tuple[int, str]:
    """Bytes of a model and what they measure: its weight files, or for a GGUF its fp32 parameters."""
    if src.gguf_file:
        return sum(p.numel() * 4 for p in model.parameters()), SIZE_GGUF
    for suffix in WEIGHT_SUFFIXES:  # safetensors first: a folder may also carry a pickled copy
        files = [f for f in src.path.glob(f"*{suffix}") if f.is_file()]
        if files:
            return sum(f.stat().st_size for f in files), SIZE_ON_DISK
    return 0, SIZE_ON_DISK


def average_accuracy(accuracy: dict[str, dict[str, float]]) -> float | None:
    from eval.tasks import PRIMARY

    values = [m[PRIMARY[t]] for t, m in accuracy.items() if PRIMARY[t] in m]
    return sum(values) / len(values) if values else None


def evaluate_model(spec: str, texts: dict[str, list[str]], tasks: list[str], limit: int | None, seqlen: int,
                   max_windows: int | None, batch_size: int = 8, progress: StepProgress = no_progress) -> ModelResult:
    """Load one model and measure its size, perplexity on each text and accuracy on each task;
    ``progress`` sees a stage per text (windows) and per task (requests), named after the model."""
    from compress.exporters.onnx_runner import is_onnx_folder, load_causal_lm
    from compress.format.checkpoint import quantized_modules
    from compress.format.models import load_model
    from eval.perplexity import perplexity
    from eval.tasks import run_tasks

    name = Path(spec).name or spec
    start = time.perf_counter()
    if is_onnx_folder(spec):  # an exported ONNX model, run on ONNX Runtime: the artifact itself is measured
        if tasks:
            raise ValueError(f"{spec} is an ONNX export: --tasks needs a torch model; use --ppl for ONNX folders")
        model, tokenizer = load_causal_lm(spec)
        size, label = sum(f.stat().st_size for f in Path(spec).glob("*.onnx*") if f.is_file()), SIZE_ON_DISK
    else:
        with quiet_third_party():
            model, tokenizer, src = load_model(spec)
        for m in quantized_modules(model).values():
            m.cache_weight()  # dequantize once instead of on every forward
        size, label = model_size(src, model)
    seconds = {"load": time.perf_counter() - start}
    ppl_detail = {}
    for text, t in texts.items():
        tick = time.perf_counter()
        stage = f"{name}: ppl {_label(text)}"
        ppl_detail[text] = perplexity(model, tokenizer, t, seqlen=seqlen, max_windows=max_windows,
                                      batch_size=batch_size, progress=lambda d, n, s=stage: progress(s, d, n, "window"))
        seconds[f"ppl {text}"] = time.perf_counter() - tick
        log.info("%s: ppl %s = %.3f (%.0f s)", spec, text, ppl_detail[text].ppl, seconds[f"ppl {text}"])
    tick = time.perf_counter()
    accuracy = (run_tasks(model, tokenizer, tasks, limit=limit, batch_size=batch_size, progress=progress,
                          label=f"{name}: ") if tasks else {})
    seconds["tasks"] = time.perf_counter() - tick
    del model
    gc.collect()
    return ModelResult(spec, size, label, None, ppl_detail, accuracy, average_accuracy(accuracy), seconds)


def evaluate(model_spec: str | None, baseline_spec: str | None = None,
             ppl_sources: list[str] | tuple[str, ...] = ("wiki",), tasks: list[str] | tuple[str, ...] = (),
             limit: int | None = None, seqlen: int = 512, max_windows: int | None = None, batch_size: int = 8,
             progress: StepProgress = no_progress, server=None) -> EvalResult:
    """The baseline (when given) and the compressed model: each one's size, ppl per text (eval split) and accuracy
    per task, and their difference;
    ``server`` (an eval/served.py ServerTarget) takes the place of ``model_spec``: the served model is scored."""
    from compress.data import load_texts
    from eval.tasks import check_limit

    if (model_spec is None) == (server is None):
        raise ValueError("give a MODEL to evaluate or --server URL, not both (--baseline MODEL sits beside a server)")
    check_limit(list(tasks), limit)
    texts = {s: load_texts(s, "eval") for s in ppl_sources}  # fail on a bad source before loading any model
    args = (texts, list(tasks), limit, seqlen, max_windows, batch_size, progress)
    baseline = evaluate_model(baseline_spec, *args) if baseline_spec else None  # freed before the next load
    if server is not None:
        from eval.served import evaluate_server

        compressed = evaluate_server(server, *args)
    else:
        compressed = evaluate_model(model_spec, *args)
    return EvalResult(baseline, compressed, Delta.between(baseline, compressed) if baseline else None,
                      Settings(seqlen, max_windows, limit))


def _fmt(value: float | None, kind: str, delta: bool = False) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    sign = "+" if delta else ""
    if kind == "size":
        return f"{value / 2**20:{sign}.1f} MB"
    if kind == "acc":
        return f"{100 * value:{sign}.1f}"
    return f"{value:{sign}.2f}"


def _label(source: str) -> str:
    return Path(source).name if source.endswith((".txt", ".jsonl")) else source


def format_table(result: EvalResult) -> str:
    """One side-by-side table: size, ppl per text, accuracy per task and average accuracy."""
    from eval.tasks import PRIMARY

    sides = {c: m for c, m in (("baseline", result.baseline), ("compressed", result.compressed)) if m}
    delta, comp, settings = result.delta, result.compressed, result.settings
    heads = ["served" if m.size_label == "served" else c for c, m in sides.items()]
    rows = [["", *(heads if delta else ["value"])] + (["delta"] if delta else [])]  # a lone model may be uncompressed

    def add(label: str, get, kind: str) -> None:
        change = [_fmt(get(delta), kind, True)] if delta else []
        rows.append([label, *(_fmt(get(m), kind) for m in sides.values()), *change])

    marks = {c: "*" if m.size_label == SIZE_GGUF else "" for c, m in sides.items()}
    rows.append(["model", *(m.model for m in sides.values())] + ([""] if delta else []))
    rows.append(["size", *(_fmt(m.size_bytes, "size") + marks[c] for c, m in sides.items())]
                + ([f"x{delta.size_ratio:.3f}" if delta.size_ratio else "-"] if delta else []))
    for name in comp.ppl:
        add(f"ppl {_label(name)}", lambda r: r.ppl[name], "ppl")
    for task, metrics in comp.accuracy.items():
        for metric in sorted((m for m in metrics if m != "samples"), key=lambda k: k != PRIMARY[task]):
            add(f"{task} {metric}", lambda r: r.accuracy[task][metric], "ppl" if metric == "perplexity" else "acc")
    if comp.accuracy:
        add("avg accuracy", lambda r: r.accuracy_avg, "acc")
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(r, widths)))
             for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    notes = [f"size: {SIZE_ON_DISK}"] if not all(marks.values()) else []
    notes += ["served: scored through the server's /v1/completions (echoed prompt logprobs)"] if any(
        m.size_label == "served" for m in sides.values()) else []
    notes += [f"* {SIZE_GGUF}"] if any(marks.values()) else []
    notes.append(f"ppl: eval split, windows of {settings.seqlen} tokens; accuracy in %")
    if comp.accuracy and settings.limit:
        notes.append(f"tasks: first {settings.limit} documents each")
    return "\n".join(lines + [""] + notes)
