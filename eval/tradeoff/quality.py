"""A variant's quality on the report's settings: size and bits per weight, perplexity and KL divergence to
the reference model on the very same windows, and task accuracy."""
from __future__ import annotations

import math
import time
from dataclasses import asdict
from pathlib import Path

import torch
from torch import nn

from eval.perplexity import mean_nll, model_device, token_windows
from eval.progress import StepProgress, no_progress, quiet_third_party
from eval.report import SIZE_ON_DISK, average_accuracy, model_size
from eval.tradeoff import kl


def load_variant(spec: str, kind: str):
    """(model, tokenizer, size in bytes, what the size measures) of a model name, folder, ONNX folder or GGUF."""
    from compress.exporters.onnx_runner import is_onnx_folder, load_causal_lm
    from compress.format.checkpoint import quantized_modules
    from compress.format.models import load_model

    if is_onnx_folder(spec):  # run on ONNX Runtime: the artifact itself is measured
        model, tokenizer = load_causal_lm(spec)
        return model, tokenizer, sum(f.stat().st_size for f in Path(spec).glob("*.onnx*") if f.is_file()), SIZE_ON_DISK
    with quiet_third_party():
        model, tokenizer, src = load_model(spec)
    for m in quantized_modules(model).values():
        m.cache_weight()  # dequantize once instead of on every forward
    if src.gguf_file and kind != "fp":  # a GGUF variant is measured as the file it is
        return model, tokenizer, (src.path / src.gguf_file).stat().st_size, SIZE_ON_DISK
    size, label = model_size(src, model)
    return model, tokenizer, size, label


def score_windows(model, windows: torch.Tensor, batch_size: int, reference: nn.Module | None,
                  progress=None) -> tuple[float, torch.Tensor | None]:
    """(mean next-token NLL, per-token KL to ``reference`` or None) over ``windows: [n, seqlen]``."""
    kls = []

    def compare(batch: torch.Tensor, logits: torch.Tensor) -> None:
        ref = reference(input_ids=batch.to(model_device(reference))).logits
        # the positions the NLL scores: each but the last predicts the next token
        kls.append(kl.token_kl(ref[:, :-1], logits[:, :-1]))

    nll = mean_nll(model, windows, batch_size, progress, compare if reference is not None else None)
    return nll, torch.cat(kls) if kls else None


def measure_quality(spec: str, kind: str, texts: dict[str, list[str]], cfg, reference: nn.Module | None,
                    progress: StepProgress = no_progress, label: str = "") -> dict:
    """Size, bits per weight, ppl and KL per text, accuracy per task; ``reference`` None means the variant
    is the reference (its KL is 0 by definition)."""
    from eval.tasks import run_tasks

    t0 = time.perf_counter()
    model, tokenizer, size, size_label = load_variant(spec, kind)
    seconds = {"load": time.perf_counter() - t0}
    params = sum(p.numel() for p in (reference if reference is not None else model).parameters())
    out = {"size_bytes": size, "size_label": size_label, "params": params,
           "bits_per_weight": 8 * size / params if params else None, "ppl": {}, "nll": {}, "kl": {}}
    for text, docs in texts.items():
        tick = time.perf_counter()
        windows = token_windows(tokenizer, docs, cfg.seqlen, cfg.max_windows)
        stage = f"{label}: ppl{'+KL' if reference is not None else ''} {Path(text).name}"
        nll, kls = score_windows(model, windows, cfg.batch_size, reference,
                                 lambda d, n, s=stage: progress(s, d, n, "window"))
        out["nll"][text], out["ppl"][text] = nll, math.exp(nll)
        out["kl"][text] = asdict(kl.summarize(kls)) if kls is not None else {"mean": 0.0, "p99": 0.0, "reference": True}
        seconds[f"ppl {text}"] = time.perf_counter() - tick
    out["windows"] = int(windows.shape[0])
    if cfg.tasks and not isinstance(model, nn.Module):
        out["accuracy"], out["accuracy_note"] = {}, "tasks need a torch model; ONNX folders get perplexity only"
    else:
        tick = time.perf_counter()
        out["accuracy"] = run_tasks(model, tokenizer, list(cfg.tasks), limit=cfg.limit, batch_size=cfg.batch_size,
                                    progress=progress, label=f"{label}: ") if cfg.tasks else {}
        seconds["tasks"] = time.perf_counter() - tick
    out["accuracy_avg"] = average_accuracy(out["accuracy"])
    out["seconds"] = seconds
    del model
    return out
