"""The bytes one decode step reads from the model's weights, traced rather than assumed: every op the step runs is
seen (a ``TorchDispatchMode``), and each weight tensor an op takes counts once, at the size it is read.

A decode step's speed on CPU is bound by these bytes: the packed linears as the kernels hold them (runtime/kernels/
w8a8.py's tiles with their fp16 scales, not the checkpoint's int32 words), the LM head (a tied int8 head reads the
whole table), the norms. A table that ops only gather rows from (the embedding, rotary caches) counts the rows
gathered. Copies the step does not touch (a dense copy for long prompts) count nothing; the KV cache is left out
(``exclude``): what it reads grows with the context, not with the model.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
GATHERS = (aten.index_select.default, aten.embedding.default, aten.index.Tensor)  # read only the rows they pick


@dataclass(frozen=True)
class StepReads:
    """Bytes of weights read in full, bytes of rows gathered from tables not otherwise read, and how many distinct
    weight storages the step touched."""

    full: int
    gathered: int
    tensors: int

    @property
    def total(self) -> int:
        return self.full + self.gathered


def _key(t: Tensor) -> int | tuple[str, int]:
    """The identity of ``t``'s memory: its storage's address (views share it), or the tensor's own id for an opaque
    one (oneDNN's prepacked weights have no storage)."""
    return ("opaque", id(t)) if t.is_mkldnn or t.layout != torch.strided else t.untyped_storage().data_ptr()


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size() if t.is_mkldnn or t.layout != torch.strided else t.untyped_storage().nbytes()


def held_storages(module: nn.Module, exclude: Iterable[Tensor] = ()) -> dict:
    """{storage address: bytes} of every tensor ``module`` holds: parameters, buffers, and tensors kept as plain
    attributes (kernels keep their arguments in tuples, a tied embedding its head in a list), less ``exclude``."""
    out: dict[int, int] = {}
    for m in module.modules():
        values = [*m._parameters.values(), *m._buffers.values(), *vars(m).values()]
        for t in pytree.tree_leaves([v for v in values if isinstance(v, (Tensor, tuple, list))]):
            if isinstance(t, Tensor) and t.device.type != "meta":
                out[_key(t)] = _nbytes(t)
    for t in exclude:
        out.pop(_key(t), None)
    return out


def _span(t: Tensor) -> tuple[int, int]:
    """The bytes of its storage ``t`` covers, [start, end): from its first element to its last, whatever its
    strides (an opaque tensor: all of it)."""
    if t.is_mkldnn or t.layout != torch.strided:
        return 0, t.numel() * t.element_size()
    last = sum((n - 1) * st for n, st in zip(t.shape, t.stride())) if t.numel() else -1
    start = t.storage_offset() * t.element_size()
    return start, start + (last + 1) * t.element_size()


def _union(spans: Iterable[tuple[int, int]]) -> int:
    """Bytes the union of [start, end) spans covers."""
    total, reach = 0, 0
    for a, b in sorted(spans):
        a = max(a, reach)
        if b > a:
            total, reach = total + b - a, b
    return total


def _covered(span: tuple[int, int], spans: Iterable[tuple[int, int]]) -> bool:
    return any(a <= span[0] and span[1] <= b for a, b in spans)


class _Reads(TorchDispatchMode):
    """Records, per held storage, the spans of it ops read in full, and the rows gathered from each table. Storages
    are told apart by address and the spans within one by offset: one storage may hold many weights (the packed
    linears in one huge-page arena: runtime/hugepages.py)."""

    def __init__(self, held: dict):
        super().__init__()
        self.held, self.full, self.gathered = held, {}, {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.is_view:  # a view reads nothing; the op that takes it does
            return out
        inputs = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, Tensor)]
        for i, t in enumerate(inputs):
            p = _key(t)
            if p not in self.held:
                continue
            if func in GATHERS and i == 0:
                key = (p, _span(t))
                self.gathered[key] = self.gathered.get(key, 0) + out.numel() * out.element_size()
            else:
                self.full.setdefault(p, set()).add(_span(t))
        return out


def trace_reads(module: nn.Module, step: Callable[[], object], exclude: Iterable[Tensor] = ()) -> StepReads:
    """Run ``step()`` once and return the bytes of ``module``'s tensors it read (see the module docstring)."""
    held = held_storages(module, exclude)
    with _Reads(held) as r:
        step()
    full = {p: min(_union(spans), held[p]) for p, spans in r.full.items()}
    # a table also read in full counts once
    gathered = sum(b for (p, span), b in r.gathered.items() if not _covered(span, r.full.get(p, ())))
    return StepReads(sum(full.values()), gathered, len(full.keys() | {p for p, _ in r.gathered}))


def decode_step_reads(engine, sampling_cls, prompt: list[int]) -> StepReads:
    """The weight bytes of one batch-1 decode step of ``engine`` (a runtime.engine.Engine with nothing in flight):
    ``prompt`` is prefilled untraced, then one decode step is traced; the KV pool is excluded. The native decode step
    (runtime/kernels/native_step.py) is one custom call the dispatcher does not see into, and reads the very buffers
    the per-op path does, so the traced step runs per-op."""
    runner = engine.runner
    engine.add_request(prompt, sampling_cls(max_tokens=3, ignore_eos=True))
    engine.step()  # the prefill (a short prompt: one step)
    kv = [t for t in (runner.kv_cache, runner.kv_scales) if t is not None]
    model, native = runner.model, getattr(runner.model, "native_step", None)
    if native is not None:
        model.native_step = None
    try:
        reads = trace_reads(model, engine.step, kv)
    finally:
        if native is not None:
            model.native_step = native
    while engine.has_unfinished():
        engine.step()
    return reads
