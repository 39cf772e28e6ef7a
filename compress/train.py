"""Distillation fine-tuning: a student learns its fp teacher's next-token distribution (KL divergence),
with AdamW, a linear-warmup cosine schedule and gradient clipping. Shared by QAT (compress/methods/qat.py, the
student's linears fake-quantize their weights) and GQA uptraining (compress/transforms/gqa.py, the student has
fewer KV heads). The caller chooses which parameters learn by passing them as ``param_groups``.
"""
from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

TRAIN_DTYPES = ("bfloat16", "float32")
TrainProgress = Callable[[int, int, float], None]  # (step, steps, loss)


@dataclass(frozen=True)
class TrainConfig:
    steps: int
    batch_size: int = 4
    warmup: float = 0.05  # fraction of steps with a linear warmup
    max_grad_norm: float = 1.0
    dtype: str = "bfloat16"  # autocast dtype of the forward passes; "float32" turns autocast off
    seed: int = 0

    def __post_init__(self):
        if self.steps < 1:
            raise ValueError(f"steps={self.steps} must be >= 1")
        if self.batch_size < 1:
            raise ValueError(f"batch_size={self.batch_size} must be >= 1")
        if not 0 <= self.warmup < 1:
            raise ValueError(f"warmup={self.warmup} must be a fraction in [0, 1)")
        if self.max_grad_norm <= 0:
            raise ValueError(f"max_grad_norm={self.max_grad_norm} must be > 0")
        if self.dtype not in TRAIN_DTYPES:
            raise ValueError(f"train dtype {self.dtype!r} is unknown; use one of {TRAIN_DTYPES}")


@dataclass
class TrainResult:
    losses: list[float] = field(default_factory=list)  # the KL of every step, before its update
    seconds: float = 0.0

    def mean(self, part: slice) -> float:
        vals = self.losses[part]
        return sum(vals) / max(len(vals), 1)

    @property
    def first(self) -> float:
        """Mean loss over the first tenth of the steps (single steps are noisy)."""
        return self.mean(slice(0, max(1, len(self.losses) // 10)))

    @property
    def last(self) -> float:
        return self.mean(slice(-max(1, len(self.losses) // 10), None))


def kl_loss(student_logits: Tensor, teacher_logits: Tensor) -> Tensor:
    """Mean over tokens of KL(teacher || student) on the next-token distributions."""
    # logits: [..., vocab] -> [tokens, vocab]
    s = F.log_softmax(student_logits.float().reshape(-1, student_logits.shape[-1]), dim=-1)
    t = F.log_softmax(teacher_logits.float().reshape(-1, teacher_logits.shape[-1]), dim=-1)
    return F.kl_div(s, t, log_target=True, reduction="batchmean")


def cosine_factor(step: int, steps: int, warmup: float) -> float:
    """Learning-rate multiplier at ``step`` (0-based): linear warmup, then cosine decay to zero."""
    n_warm = int(steps * warmup)
    if step < n_warm:
        return (step + 1) / (n_warm + 1)
    progress = (step - n_warm) / max(1, steps - n_warm)
    return 0.5 * (1 + math.cos(math.pi * progress))


def autocast(dtype: str):
    if dtype == "float32":
        return contextlib.nullcontext()
    return torch.autocast("cpu", dtype=getattr(torch, dtype))


def _batches(ids: Tensor, batch_size: int, seed: int):
    """Endless batches of rows of ``ids: [n, seqlen]``, reshuffled every epoch."""
    gen = torch.Generator().manual_seed(seed)
    while True:
        perm = torch.randperm(ids.shape[0], generator=gen)
        for i in range(0, len(perm), batch_size):
            yield ids[perm[i:i + batch_size]]


@torch.no_grad()
def evaluate_kl(student: nn.Module, teacher: nn.Module, ids: Tensor, batch_size: int = 4,
                dtype: str = "float32") -> float:
    """Mean KL(teacher || student) over the rows of ``ids`` (for measuring, no gradients)."""
    total, n = 0.0, 0
    for i in range(0, ids.shape[0], batch_size):
        x = ids[i:i + batch_size]
        with autocast(dtype):
            loss = kl_loss(student(input_ids=x).logits, teacher(input_ids=x).logits)
        total += loss.item() * x.shape[0]
        n += x.shape[0]
    return total / n


def distill(student: nn.Module, teacher: nn.Module, ids: Tensor, param_groups: list[dict], cfg: TrainConfig,
            progress: TrainProgress | None = None) -> TrainResult:
    """Fine-tune the parameters in ``param_groups`` (AdamW groups, each with its own ``lr``) so that
    ``student`` matches ``teacher`` on windows of token ids ``ids: [n, seqlen]``."""
    if ids.ndim != 2 or ids.shape[0] == 0:
        raise ValueError(f"training needs token windows [n, seqlen], got shape {tuple(ids.shape)}")
    params = [p for g in param_groups for p in g["params"]]
    assert params and all(p.requires_grad for p in params), "every trained parameter must require grad"
    teacher.eval()
    student.eval()  # no dropout: the student is the deployed model, only its trained parameters move
    opt = torch.optim.AdamW(param_groups, weight_decay=0.0)
    base = [g["lr"] for g in opt.param_groups]
    result = TrainResult()
    t0 = time.perf_counter()
    batches = _batches(ids, cfg.batch_size, cfg.seed)
    for step in range(cfg.steps):
        x = next(batches)
        factor = cosine_factor(step, cfg.steps, cfg.warmup)
        for g, lr in zip(opt.param_groups, base):
            g["lr"] = lr * factor
        with torch.no_grad(), autocast(cfg.dtype):
            target = teacher(input_ids=x).logits
        with autocast(cfg.dtype):
            logits = student(input_ids=x).logits
        loss = kl_loss(logits, target)
        del target, logits
        if not torch.isfinite(loss):
            raise ValueError(f"training diverged at step {step} (loss {loss.item()}); lower the learning rate")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
        opt.step()
        result.losses.append(loss.item())
        if progress:
            progress(step + 1, cfg.steps, result.losses[-1])
    opt.zero_grad(set_to_none=True)
    result.seconds = time.perf_counter() - t0
    return result
