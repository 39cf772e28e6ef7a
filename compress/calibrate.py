"""The layer-by-layer drivers every method runs on, and what the pipeline hands a method (:class:`Run`).

``run_blocks`` visits each decoder block for the data-free methods. ``run_sequential`` captures the
inputs of the first block with a forward pre-hook (running only the embeddings and that one block),
then for each block: the per-block algorithm observes and quantizes it, the driver runs the quantized
block on the same inputs, and its outputs become the next block's inputs (the sequential scheme of
GPTQ and AWQ). Only one block's activations are held at a time, so peak memory is the fp model plus
two sets of hidden states; with a streaming :class:`BlockStore` (compress/stream.py) only one block is
materialized at a time as well.
"""
from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch
from torch import Tensor, nn

from compress.errors import during
from compress.format.checkpoint import set_module
from compress.format.host import trim
from compress.format.mappings import KEEP_FP
from compress.format.qlinear import QuantLinear
from compress.format.quant import QuantizedWeight
from compress.methods.common.report import ExpertRecord, QuantizeReport
from compress.offload import DiskTensors, empty_like

if TYPE_CHECKING:
    from compress.config import QuantizeConfig

log = logging.getLogger(__name__)


class Progress(Protocol):
    """(done, total) of a pass over ``unit``s: blocks (calibration, KV fitting), or windows (QAT sampling its own
    training text, compress/methods/common/selfdata.py). A pass announces itself with done == 0 before its first unit
    (so a bar's clock starts with the pass, not after its first unit); one that does not begins at done == 1 or with
    another unit (sampling reports once per batch of windows, so its first call may be done > 1)."""

    def __call__(self, done: int, total: int, unit: str = "block") -> None: ...


TrainProgress = Callable[[int, int, float], None]  # (step, steps, loss) of QAT / uptraining


@dataclass
class BlockInputs:
    """Inputs of one decoder block for every calibration batch: hidden states plus the model's kwargs."""

    hidden: list[Tensor]
    kwargs: list[dict] = field(default_factory=list)
    autocast: torch.dtype | None = None  # e.g. bfloat16: run blocks in reduced precision (stats stay fp32)
    # every block's own kwargs per batch, as the model passes them (captured once): the attention mask and rotary
    # tables differ between a model's sliding and global layers (Gemma 2/3); None: every block takes ``kwargs``
    layer_kwargs: list[list[dict]] | None = None

    def next(self, outputs: list[Tensor], i: int) -> "BlockInputs":
        """Block ``i``'s inputs: the previous block's ``outputs`` with block ``i``'s own kwargs."""
        kwargs = self.layer_kwargs[i] if self.layer_kwargs is not None and i < len(self.layer_kwargs) else self.kwargs
        return BlockInputs(outputs, kwargs, self.autocast, self.layer_kwargs)

    @property
    def tokens(self) -> int:
        return sum(h.shape[0] * h.shape[1] for h in self.hidden)

    def split(self, held: int) -> tuple["BlockInputs", "BlockInputs | None"]:
        """The inputs of the batches a method fits on, and of the last ``held`` ones (None when 0) that judge it
        (compress/methods/common/fallback.py)."""
        n = len(self.hidden) - held
        if not held:
            return self, None
        return (BlockInputs(_part(self.hidden, 0, n), self.kwargs[:n], self.autocast),
                BlockInputs(_part(self.hidden, n, len(self.hidden)), self.kwargs[n:], self.autocast))

    @torch.inference_mode()
    def forward(self, block: nn.Module, outs: list[Tensor] | None = None) -> list[Tensor]:
        """Run ``block`` on every batch; returns its output hidden states (appended to ``outs`` when given)."""
        outs = empty_like(self.hidden) if outs is None else outs
        with torch.autocast("cpu", dtype=self.autocast or torch.bfloat16, enabled=self.autocast is not None):
            for h, kw in zip(self.hidden, self.kwargs):
                out = block(h, **kw)
                outs.append((out[0] if isinstance(out, tuple) else out).float())
        return outs


def _part(hidden, start: int, stop: int):
    return hidden.part(start, stop) if isinstance(hidden, DiskTensors) else hidden[start:stop]


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The model's list of decoder blocks: the ModuleList holding ``num_hidden_layers`` modules."""
    n = model.config.num_hidden_layers
    for _, m in model.named_modules():
        if isinstance(m, nn.ModuleList) and len(m) == n:
            return m
    raise ValueError(f"could not find the {n} decoder layers of {type(model).__name__}")


def layers_name(model: nn.Module) -> str:
    """The full module name of the decoder blocks' list (``model.layers``): block ``i`` is ``{name}.{i}``."""
    layers = decoder_layers(model)
    return next(n for n, m in model.named_modules() if m is layers)


def kept_fp(name: str, ignore: tuple[str, ...]) -> bool:
    """Whether the module ``name`` (full name) stays in fp: the output head, a router, or named by ``ignore``
    (regular expressions searched in the name)."""
    return any(re.search(p, name) for p in (*KEEP_FP, *ignore))


def target_linears(block: nn.Module, ignore: tuple[str, ...], prefix: str = "") -> dict[str, nn.Linear]:
    """The block's ``nn.Linear`` layers to quantize (relative names; ``prefix`` + the relative name is the full
    name), minus those that stay in fp (:func:`kept_fp`)."""
    return {n: m for n, m in block.named_modules() if isinstance(m, nn.Linear) and not kept_fp(f"{prefix}{n}", ignore)}


def swap_linear(block: nn.Module, name: str, lin: nn.Linear, qw: QuantizedWeight) -> None:
    """Replace ``block``'s linear ``name`` by the packed :class:`QuantLinear` of ``qw``."""
    set_module(block, name, QuantLinear.from_quantized(qw, lin.bias, dtype=lin.weight.dtype))


def backbone(model: nn.Module) -> nn.Module:
    """The decoder stack without the LM head: forwards that need the blocks' inputs skip the logits."""
    return model.get_decoder() if hasattr(model, "get_decoder") else model


def _drop_cache_kwargs(kwargs: dict) -> dict:
    return {k: v for k, v in kwargs.items() if k not in ("past_key_values", "past_key_value", "use_cache")}


@torch.inference_mode()
def capture_inputs(model: nn.Module, batches: list[Tensor], offload: Path | None = None) -> BlockInputs:
    """Hidden states entering the first decoder block, and the kwargs the model hands each block, for each batch of
    token ids (the hidden states written to disk under ``offload`` as they come, when given). The blocks do not run:
    each one's forward is replaced, for the pass, by one that records its inputs and hands the hidden states on."""
    layers = decoder_layers(model)
    captured = BlockInputs([] if offload is None else DiskTensors(offload), [], layer_kwargs=[[] for _ in layers])

    def recorder(i: int):
        def forward(*args, **kwargs):
            hidden = args[0] if args else kwargs.pop("hidden_states")
            if i == 0:
                captured.hidden.append(hidden.detach())
            captured.layer_kwargs[i].append(_drop_cache_kwargs(kwargs))
            return hidden
        return forward

    for i, layer in enumerate(layers):
        layer.forward = recorder(i)  # an instance attribute: nn.Module.__call__ finds it before the class's
    try:
        base = backbone(model)
        for ids in batches:
            base(input_ids=ids, use_cache=False)
    finally:
        for layer in layers:
            del layer.forward
    captured.kwargs = captured.layer_kwargs[0]
    return captured


def check_finite(hidden: list[Tensor], where: str) -> None:
    for h in hidden:
        if not torch.isfinite(h).all():
            raise ValueError(f"non-finite activations (NaN/Inf) {where}; the model or calibration data is broken "
                             "(try float32, or another --calib source)")


# a per-block step may return the block's outputs, taken before it quantized the block: the driver hands those on
# (GPTQ's sequential: false, the fp model's activations) instead of running the quantized block
PerBlock = Callable[[int, nn.Module, BlockInputs], "list[Tensor] | None"]


class BlockStore:
    """Where the decoder blocks' weights live. This one: in the model already (nothing to do);
    compress/stream.py's streams each block in from disk before its turn and out after it. ``offload``: a folder
    where the calibration activations live instead of memory (compress/offload.py)."""

    def __init__(self, offload: Path | None = None):
        self.offload = offload

    def load(self, i: int, block: nn.Module) -> None:
        pass

    def release(self, i: int, block: nn.Module) -> None:
        pass

    def capture(self, model: nn.Module, batches: list[Tensor]) -> BlockInputs:
        return capture_inputs(model, batches, self.offload)

    def finished(self, outputs: "BlockInputs") -> None:
        """The last block's outputs (a streamed run keeps them for the head's calibration)."""


IN_MEMORY = BlockStore()


@dataclass
class Run:
    """What the pipeline hands every method besides the model and its config (one signature for all:
    ``quantize(model, cfg, run)``, compress/pipeline.py METHODS)."""

    report: QuantizeReport
    batches: list[Tensor] | None = None  # calibration token ids
    progress: Progress | None = None
    train_progress: TrainProgress | None = None
    store: BlockStore = IN_MEMORY  # where the blocks' weights live (compress/stream.py streams them)
    # a mixture-of-experts model's expert step, run after each block's linears (compress/methods/common/moe.py
    # BlockExperts): ``experts(i, block, inputs=None, expert=None) -> records``; None for a dense model
    experts: Callable[..., list[ExpertRecord]] | None = None
    teacher: nn.Module | None = None  # the fp model to distil from, when an earlier step kept one
    # QAT's GPTQ init (compress/methods/qat.py): GPTQ puts each linear's pre-rounding weights here, keyed by the linear
    latents: dict[nn.Module, Tensor] | None = None
    # the last ``holdout`` batches are held-out calibration windows: the method fits on the others and keeps RTN
    # where it is better on these (compress/methods/common/fallback.py); 0: every batch fits
    holdout: int = 0
    # QAT's init (compress/methods/qat.py): the adapter of method ``cfg.qat.init`` (awq or gptq), handed over by the
    # pipeline so that QAT imports no other method; None otherwise
    ptq: Method | None = None

    @property
    def fit_batches(self) -> list[Tensor] | None:
        return self.batches[:len(self.batches) - self.holdout] if self.batches is not None else None

    @property
    def held_batches(self) -> list[Tensor]:
        return self.batches[len(self.batches) - self.holdout:] if self.holdout else []


Method = Callable[[nn.Module, "QuantizeConfig", Run], None]  # every method's adapter (compress/pipeline.py METHODS)


def autocast_of(calib_dtype: str) -> torch.dtype | None:
    """The CPU autocast dtype of calibration block forwards (None: full precision)."""
    return torch.bfloat16 if calib_dtype == "bfloat16" else None


def _tagged(per_block: PerBlock, n: int) -> PerBlock:
    """``per_block`` whose faults say which block they happened in (compress/errors.py)."""
    def tagged(i: int, block: nn.Module, inputs: BlockInputs | None) -> list[Tensor] | None:
        with during(f"quantizing block {i} of {n}"):
            return per_block(i, block, inputs)
    return tagged


def run_blocks(model: nn.Module, per_block: PerBlock, progress: Progress | None = None,
               store: BlockStore = IN_MEMORY) -> None:
    """Call ``per_block(i, block, None)`` for each decoder block in order: no activations (data-free methods)."""
    layers = decoder_layers(model)
    per_block = _tagged(per_block, len(layers))
    if progress:
        progress(0, len(layers))
    for i, block in enumerate(layers):
        store.load(i, block)
        per_block(i, block, None)
        store.release(i, block)
        if progress:
            progress(i + 1, len(layers))


def _forward_quantized(block: nn.Module, inputs: BlockInputs) -> list[Tensor]:
    cached = [m for m in block.modules() if hasattr(m, "cache_weight")]  # packed linears just swapped in
    for m in cached:  # dequantize once for all batches, not once per batch
        m.cache_weight()
    try:
        return inputs.forward(block)
    finally:
        for m in cached:
            m.cache_weight(False)


def run_sequential(model: nn.Module, batches: list[Tensor], per_block: PerBlock, progress: Progress | None = None,
                   autocast: torch.dtype | None = None, store: BlockStore = IN_MEMORY) -> None:
    """Call ``per_block(i, block, inputs)`` for each decoder block in order, feeding each block the
    outputs of the already-processed (quantized) previous block, or those ``per_block`` returned."""
    layers = decoder_layers(model)
    per_block = _tagged(per_block, len(layers))
    store.load(0, layers[0])
    with during("capturing the first block's inputs"):
        inputs = store.capture(model, batches)
    inputs.autocast = autocast
    check_finite(inputs.hidden, "entering block 0")
    if progress:
        progress(0, len(layers))
    for i, block in enumerate(layers):
        store.load(i, block)
        outputs = per_block(i, block, inputs)
        if outputs is None:
            outputs = _forward_quantized(block, inputs)
        store.release(i, block)
        check_finite(outputs, f"after block {i}")
        inputs = inputs.next(outputs, i + 1)
        trim()  # the block's statistics and temporaries, freed: back to the OS before the next block's
        if progress:
            progress(i + 1, len(layers))
    store.finished(inputs)


def quantize_blocks(model: nn.Module, cfg: QuantizeConfig, run: Run,
                    weight: Callable[[Tensor], QuantizedWeight]) -> None:
    """The adapter of a data-free method (RTN, NF4): each block's linears by ``weight`` from their weights alone,
    then its MoE experts."""
    prefix = layers_name(model)

    def per_block(i: int, block: nn.Module, _) -> None:
        for name, lin in target_linears(block, cfg.ignore, f"{prefix}.{i}.").items():
            swap_linear(block, name, lin, weight(lin.weight.data))
        if run.experts is not None:
            run.report.layers.extend(run.experts(i, block))
    run_blocks(model, per_block, run.progress, run.store)
