"""Streaming quantization: a model larger than RAM goes through the layer-by-layer pass one block at a time.

The model is built on the ``meta`` device (parameters without storage; buffers such as rotary
frequencies are real), and :class:`StreamedBlocks`, a :class:`~compress.calibrate.BlockStore`,
materializes decoder block ``i`` from the source shards just before its turn (through
transformers' own checkpoint conversion, so fused MoE experts load as ``from_pretrained`` would
load them), writes its packed tensors to a part file once it is quantized, and sends it back to
``meta``; at the end the parts are regrouped into ``model.safetensors`` (or ~2 GB shards and an index). The embeddings and the untied head are never materialized: calibration looks up only
the rows its tokens use, and both are copied to the output a slab of rows at a time (or, with ``embed``/``head``,
quantized slab by slab: compress/methods/embed_head.py). Every tensor
is computed exactly as on the in-memory path (fp32, the same per-block code), so the two paths write
the same tensors; both keep the tensors outside the blocks (embeddings, head, final norm), which
quantization does not touch, in the source's dtype (:func:`outer_dtypes`).
"""
from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor, nn

from compress.calibrate import BlockInputs, BlockStore, capture_inputs, decoder_layers
from compress.format.host import trim
from compress.format.quant import QuantizedWeight
from compress.format.shards import Lazy, ShardReader, consolidate, write_shard
from compress.methods.embed_head import OuterPlan, quantize_table, table_of

DTYPE = torch.float32  # blocks are materialized (and the other tensors written) as the in-memory path loads them
MAX_SHARD_BYTES = 2 << 30  # the output: one model.safetensors up to this size, else shards of about this size


def skeleton(folder: Path, trust_remote_code: bool = False) -> nn.Module:
    """The model of ``folder``'s config with every parameter on ``meta`` and its buffers real."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=DTYPE, trust_remote_code=trust_remote_code)
    return model.eval()


def layers_prefix(model: nn.Module) -> str:
    layers = decoder_layers(model)
    return next(n for n, m in model.named_modules() if m is layers)


def tied(model: nn.Module) -> bool:
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return bool(getattr(cfg, "tie_word_embeddings", False))


def _param_name(model: nn.Module, module: nn.Module | None) -> str | None:
    if module is None:
        return None
    return next((f"{n}.weight" for n, m in model.named_modules() if m is module), None)


@contextlib.contextmanager
def _quiet_transformers():
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


def load_tensors(model: nn.Module, tensors: dict[str, Tensor]) -> None:
    """Load checkpoint tensors (checkpoint names) into ``model`` through transformers' own conversion."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import convert_and_load_state_dict_in_model
    from transformers.modeling_utils import LoadStateDictConfig

    cfg = LoadStateDictConfig(dtype=DTYPE, weight_mapping=get_model_conversion_mapping(model))
    with _quiet_transformers():
        convert_and_load_state_dict_in_model(model, tensors, cfg)


def model_names(model: nn.Module, keys) -> dict[str, str]:
    """Checkpoint key -> the model's own name for it, by transformers' renamings (GPT-NeoX's embed_out is lm_head)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightRenaming, apply_renamings

    renamings = [t for t in get_model_conversion_mapping(model) or () if isinstance(t, WeightRenaming)]
    return {k: apply_renamings(k, renamings) for k in keys}


def _check_materialized(module: nn.Module, what: str, folder: Path) -> None:
    left = [n for n, p in module.named_parameters() if p.is_meta]
    if left:
        raise ValueError(f"{folder}: the checkpoint has no tensors for {what} {', '.join(left[:4])}; "
                         "its names do not match the model's config (a converted or partial checkpoint?)")


@dataclass
class StreamStats:
    block_bytes: int = 0  # the largest decoder block materialized (fp32)
    block_seconds: list[float] = field(default_factory=list)


class StreamedBlocks(BlockStore):
    """Decoder blocks streamed from ``reader``'s shards into ``model`` and out to shards in ``out``."""

    def __init__(self, model: nn.Module, reader: ShardReader, out: Path, offload: Path | None = None,
                 gguf: bool = False):
        super().__init__(offload)
        self.model, self.reader, self.out = model, reader, out
        self.dtypes = outer_dtypes(model, reader, gguf)  # model name -> the dtype it is written in
        self.prefix = layers_prefix(model)
        n = len(decoder_layers(model))
        self.block_keys: list[list[str]] = [[] for _ in range(n)]
        self.other_keys: list[str] = []
        for k in reader.keys():
            head, _, rest = k.partition(f"{self.prefix}.") if k.startswith(f"{self.prefix}.") else ("", "", "")
            idx = rest.split(".", 1)[0]
            if idx.isdigit() and int(idx) < n:
                self.block_keys[int(idx)].append(k)
            else:
                self.other_keys.append(k)
        self.source = {v: k for k, v in model_names(model, self.other_keys).items()}  # model name -> checkpoint key
        self.parts: list[Path] = []
        self.stats = StreamStats()
        self._t0 = 0.0
        self.final: BlockInputs | None = None  # the last block's outputs, for a calibrated head
        self.embed = _param_name(model, model.get_input_embeddings())
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        self.head = None if tied(model) else _param_name(model, head)
        self._load_others()

    def _load_others(self) -> None:
        """Everything outside the blocks except the embeddings and the head (the final norm, ...)."""
        big = {self.source.get(k, k) for k in (self.embed, self.head, "lm_head.weight")}
        small = [k for k in self.other_keys if k not in big]
        load_tensors(self.model, {k: self.reader.get(k) for k in small})
        for name in (self.embed, self.head):
            if name is not None and self.source.get(name, name) not in self.reader:
                raise ValueError(f"{self.reader.folder}: no tensor {self.source.get(name, name)} in the checkpoint")

    def load(self, i: int, block: nn.Module) -> None:
        if not any(p.is_meta for p in block.parameters()):
            return  # block 0 is loaded once before calibration captures its inputs
        self._t0 = time.perf_counter()
        load_tensors(self.model, {k: self.reader.get(k) for k in self.block_keys[i]})
        _check_materialized(block, f"block {i}:", self.reader.folder)
        self.stats.block_bytes = max(self.stats.block_bytes, sum(p.numel() * p.element_size()
                                                                 for p in block.parameters()))

    def release(self, i: int, block: nn.Module) -> None:
        tensors = {f"{self.prefix}.{i}.{k}": v for k, v in block.state_dict().items()}
        self._write(tensors)
        block.to("meta")
        trim()
        self.stats.block_seconds.append(time.perf_counter() - self._t0)

    def capture(self, model: nn.Module, batches: list[Tensor]) -> BlockInputs:
        """Block 0's inputs, looking up only the embedding rows the calibration tokens use."""
        emb = model.get_input_embeddings()
        ids = torch.unique(torch.cat([b.flatten() for b in batches]))
        rows, start = [], 0
        for slab in self.reader.slabs(self.source.get(self.embed, self.embed), DTYPE):
            stop = start + slab.shape[0]
            rows.append(slab[ids[(ids >= start) & (ids < stop)] - start])
            start = stop
        full, pad = emb.weight, getattr(emb, "padding_idx", None)
        emb.weight = nn.Parameter(torch.cat(rows), requires_grad=False)
        # padding_idx indexes the full vocabulary (often one of its last rows) and only masks gradients: the
        # compacted table may not hold that row, and nn.Embedding refuses an index past its end
        if pad is not None:
            emb.padding_idx = None
        try:
            return capture_inputs(model, [torch.searchsorted(ids, b) for b in batches], self.offload)
        finally:
            emb.weight = full
            if pad is not None:
                emb.padding_idx = pad

    def finished(self, outputs: BlockInputs) -> None:
        self.final = outputs

    def head_weight(self) -> Tensor:
        """The head's weight (the tied table's on a tied model) as stored, read whole: GPTQ rounds it a slab of rows
        at a time, each in fp32 (compress/methods/head_gptq.py)."""
        name = self.embed if self.head is None else self.head
        return self.reader.get(self.source.get(name, name))

    def _quantized_table(self, name: str, src: str, scheme, codes: QuantizedWeight | None = None
                         ) -> dict[str, Tensor]:
        """``name``'s table quantized from the source a slab of rows at a time (only the packed result is held; a
        head's bias is written as any other tensor), or packed from ``codes`` already rounded (a calibrated head)."""
        rows, cols = self.reader.entries[src].shape
        prefix = name.rsplit(".", 1)[0]
        table = table_of(codes) if codes is not None else quantize_table(self.reader.slabs(src, DTYPE), rows, cols,
                                                                          scheme)
        return {f"{prefix}.{k}": v for k, v in table.state_dict().items()}

    def _write(self, tensors: dict[str, Tensor | Lazy]) -> None:
        self.parts.append(self.out / f".part-{len(self.parts):05d}.safetensors")
        write_shard(self.parts[-1], tensors)

    def finish(self, plan: OuterPlan | None = None, head_codes: QuantizedWeight | None = None) -> None:
        """Everything outside the blocks (the embedding and head quantized slab by slab as ``plan`` says; the head,
        or the tied table, from ``head_codes`` when calibrated), then the parts regrouped into the checkpoint's shards."""
        tensors: dict[str, Tensor | Lazy] = {}
        quantized = {} if plan is None else {self.embed: plan.embed, self.head: plan.head}
        codes = {self.embed if self.head is None else self.head: head_codes}
        for k, v in self.model.state_dict().items():
            if k.startswith(f"{self.prefix}.") or (k == "lm_head.weight" and tied(self.model)):
                continue
            src = self.source.get(k, k)
            if src not in self.reader:
                raise ValueError(f"{self.reader.folder}: no tensor {src} in the checkpoint")
            if quantized.get(k) is not None:
                tensors.update(self._quantized_table(k, src, quantized[k], codes.get(k)))
                continue
            e, dt = self.reader.entries[src], self.dtypes.get(k, self.reader.entries[src].dtype)
            tensors[k] = Lazy(dt, e.shape, lambda s=src, dt=dt: self.reader.slabs(s, dt)) if v.is_meta else v.to(dt)
        self._write(tensors)
        consolidate(self.parts, self.out, MAX_SHARD_BYTES)


GGUF_OUTER_DTYPE = torch.bfloat16  # compress/exporters/dtypes.py's rule for a GGUF source: float32's range, half the size


def _float_dtypes(model: nn.Module, reader: ShardReader, blocks: bool) -> dict[str, torch.dtype]:
    """The stored dtype of every floating tensor inside (``blocks``) or outside the decoder blocks, by model name."""
    prefix = f"{layers_prefix(model)}."
    names = model_names(model, reader.entries)
    return {names[k]: e.dtype for k, e in reader.entries.items()
            if e.dtype.is_floating_point and names[k].startswith(prefix) == blocks}


def outer_dtypes(model: nn.Module, reader: ShardReader, gguf: bool = False) -> dict[str, torch.dtype]:
    """The dtype to write every floating tensor outside the decoder blocks in, by name: the source's stored one;
    for a GGUF source (``gguf``: ``reader`` is its fp32 dequantized cache, whose float type is not the original's)
    bfloat16, never the cache's widened fp32."""
    return {n: GGUF_OUTER_DTYPE if gguf else dt for n, dt in _float_dtypes(model, reader, blocks=False).items()}


def blocks_bfloat16(model: nn.Module, reader: ShardReader) -> bool:
    """Whether the source stores every floating tensor of the decoder blocks in bfloat16 (what guided GPTQ's gradient
    pass then holds as bfloat16: compress/memory.py)."""
    floats = _float_dtypes(model, reader, blocks=True).values()
    return bool(floats) and all(d == torch.bfloat16 for d in floats)


def write_side_files(model: nn.Module, src_folder: Path, tokenizer, out: Path, quantization_config: dict) -> None:
    """config.json (with the quantization config), generation_config.json and the tokenizer."""
    cfg = model.config.to_dict()
    cfg["quantization_config"] = quantization_config
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    gen = src_folder / "generation_config.json"
    if gen.is_file():
        (out / gen.name).write_text(gen.read_text())
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
