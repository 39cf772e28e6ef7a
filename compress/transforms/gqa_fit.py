"""Layer-wise fitting of converted attention to the original's (the ``kv_fit_steps`` of compress/transforms/gqa.py).

A KV-head merge (compress/transforms/gqa_pca.py) is the best fit of a proxy, the projections' outputs, not of the
attention output itself, whose softmax it ignores. Here each converted attention module learns, on its
own, to reproduce what the original module outputs for the original model's hidden states: Adam on its
q/k/v/o parameters against the relative squared error, a cosine schedule, one layer at a time, forward
passes under bf16 autocast by default (1.4x faster than fp32 on this project's 2-core machine; the errors
being fitted, 0.1-0.5 relative, are far above bf16's rounding, which moves them in the sixth digit). A layer's step costs a forward and backward of one attention module, about 1/100 of an
end-to-end distillation step of the whole model, so hundreds of steps per layer fit in minutes; the
end-to-end uptraining that may follow then starts far closer (on SmolLM2 3 -> 1 KV heads, see BENCHMARKS.md).

Why the original's inputs and not the converted model's own (which would let a layer correct the drift of
the layers before it): on SmolLM2 3 -> 1, 150 steps a layer, the own-input fit scored held-out wiki
perplexity (32 windows) 36.0 and a drift-correcting target 33.2, against 33.3 for this simpler, faster one.

The teacher's hidden states walk through its blocks with the layer-by-layer driver (compress/calibrate.py):
one block's activations are held at a time, so memory is bounded as in calibration: about four fp32
copies of ``windows x seqlen x hidden`` (the block's inputs and outputs, the attention's inputs and outputs),
0.6 GB for SmolLM2 with 256 windows of 256 tokens.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from compress.train import autocast, cosine_factor

FitProgress = Callable[[int, int, float, float], None]  # (layer, layers, error before, error after)


@dataclass
class FitResult:
    errors: list[tuple[float, float]] = field(default_factory=list)  # per layer: relative error before, after
    seconds: float = 0.0

    @property
    def mean_before(self) -> float:
        return sum(b for b, _ in self.errors) / max(len(self.errors), 1)

    @property
    def mean_after(self) -> float:
        return sum(a for _, a in self.errors) / max(len(self.errors), 1)


@dataclass
class AttentionIO:
    """What one attention module saw and returned, per calibration batch."""

    inputs: list[Tensor] = field(default_factory=list)  # [b, T, hidden]
    outputs: list[Tensor] = field(default_factory=list)  # [b, T, hidden]
    kwargs: list[dict] = field(default_factory=list)  # position embeddings, mask, ...


def _attention_kwargs(kwargs: dict) -> dict:
    drop = ("hidden_states", "past_key_values", "past_key_value", "cache", "use_cache", "output_attentions")
    return {k: v for k, v in kwargs.items() if k not in drop}


def _plain(x):
    """An ordinary tensor from one made under inference mode (those cannot be saved for backward)."""
    if isinstance(x, Tensor):
        return x.clone()
    if isinstance(x, (tuple, list)):
        return type(x)(_plain(v) for v in x)
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    return x


def relative_error(out: Tensor, target: Tensor) -> Tensor:
    """``E|out - target|^2 / E|target|^2``."""
    return (out - target).pow(2).mean() / target.pow(2).mean().clamp_min(1e-12)


def _run(attn: nn.Module, io: AttentionIO, i: int) -> Tensor:
    out = attn(io.inputs[i], **io.kwargs[i])
    return out[0] if isinstance(out, tuple) else out


def _loss(attn: nn.Module, io: AttentionIO, i: int, dtype: str) -> Tensor:
    with autocast(dtype):
        out = _run(attn, io, i)
    return relative_error(out.float(), io.outputs[i])


@torch.no_grad()
def _error(attn: nn.Module, io: AttentionIO, dtype: str) -> float:
    return sum(_loss(attn, io, i, dtype).item() for i in range(len(io.inputs))) / len(io.inputs)


def fit_attention(attn: nn.Module, io: AttentionIO, steps: int, lr: float, seed: int = 0,
                  dtype: str = "bfloat16") -> tuple[float, float]:
    """Train every parameter of ``attn`` for ``steps`` batches to reproduce ``io`` (forward passes under
    ``dtype`` autocast, "float32" for none); returns the mean relative error over all batches before and after."""
    params = list(attn.parameters())
    flags = [p.requires_grad for p in params]
    before = _error(attn, io, dtype)
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.Adam(params, lr=lr)
    gen = torch.Generator().manual_seed(seed)
    try:
        for step in range(steps):
            for g in opt.param_groups:
                g["lr"] = lr * cosine_factor(step, steps, warmup=0.0)
            i = int(torch.randint(len(io.inputs), (1,), generator=gen))
            loss = _loss(attn, io, i, dtype)
            if not torch.isfinite(loss):
                raise ValueError(f"attention fitting diverged at step {step}; lower kv_fit_lr (now {lr})")
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    finally:
        for p, flag in zip(params, flags):
            p.requires_grad_(flag)
            p.grad = None
    return before, _error(attn, io, dtype)


def fit_to_teacher(student: nn.Module, teacher: nn.Module, batches: list[Tensor], attn_name: str, steps: int,
                   lr: float, seed: int = 0, progress: FitProgress | None = None,
                   dtype: str = "bfloat16") -> FitResult:
    """Fit each of ``student``'s attention modules (``attn_name`` in every decoder block) to the
    corresponding module of ``teacher`` on the teacher's own hidden states for ``batches`` of token ids."""
    from compress.calibrate import capture_inputs, check_finite, decoder_layers

    s_layers, t_layers = decoder_layers(student), decoder_layers(teacher)
    if len(s_layers) != len(t_layers):
        raise ValueError(f"student has {len(s_layers)} decoder blocks, teacher {len(t_layers)}")
    start = time.perf_counter()
    result = FitResult()
    inputs = capture_inputs(teacher, batches)
    for i, (s_block, t_block) in enumerate(zip(s_layers, t_layers)):
        io = AttentionIO()

        def hook(module, args, kwargs, out):  # runs in inference mode: copied out below
            io.inputs.append(args[0] if args else kwargs["hidden_states"])
            io.outputs.append((out[0] if isinstance(out, tuple) else out).float())
            io.kwargs.append(_attention_kwargs(kwargs))

        handle = t_block.get_submodule(attn_name).register_forward_hook(hook, with_kwargs=True)
        try:
            outputs = inputs.forward(t_block)
        finally:
            handle.remove()
        io = AttentionIO(_plain(io.inputs), _plain(io.outputs), _plain(io.kwargs))
        check_finite(outputs, f"after teacher block {i}")
        result.errors.append(fit_attention(s_block.get_submodule(attn_name), io, steps, lr, seed + i, dtype))
        inputs = inputs.next(outputs, i + 1)
        if progress:
            progress(i + 1, len(s_layers), *result.errors[-1])
    result.seconds = time.perf_counter() - start
    return result
