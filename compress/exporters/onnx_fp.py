"""ONNX decoder with a key/value cache, traced by torch's dynamo exporter (``--format onnx``).

The graph's inputs and outputs follow what optimum's ``ORTModelForCausalLM`` feeds and reads:
``input_ids``, ``attention_mask`` [batch, past + sequence], ``position_ids``,
``past_key_values.N.key`` / ``.value`` [batch, kv_heads, past, head_dim] -> ``logits``,
``present.N.key`` / ``.value`` [batch, kv_heads, past + sequence, head_dim]. Batch, sequence and
past lengths are dynamic (past may be 0 on the first step). ``config.json``,
``generation_config.json`` and the tokenizer lie beside ``model.onnx``.

A quantized source is exported with its dequantized weights (``--format onnx-int4`` keeps the integers).
"""
from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from compress.format.checkpoint import set_module
from compress.exporters.common import Source, check_onnx_architecture, export_config, write_side_files
from compress.format.models import cache_kwarg
from compress.format.qlinear import QuantLinear

log = logging.getLogger(__name__)

OPSET = 18
MODEL_FILE = "model.onnx"


def input_names(n_layers: int) -> list[str]:
    return ["input_ids", "attention_mask", "position_ids"] + [
        f"past_key_values.{i}.{kv}" for i in range(n_layers) for kv in ("key", "value")]


def output_names(n_layers: int) -> list[str]:
    return ["logits"] + [f"present.{i}.{kv}" for i in range(n_layers) for kv in ("key", "value")]


def kv_shape(config) -> tuple[int, int]:
    """(kv_heads, head_dim) of one layer's cache."""
    heads = config.num_key_value_heads or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return heads, head_dim


class KVCacheDecoder(nn.Module):
    """Flat past tensors in, a DynamicCache inside, flat present tensors out."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        self.n_layers = model.config.num_hidden_layers
        self.cache_kw = cache_kwarg(model)

    def forward(self, input_ids, attention_mask, position_ids, past: list[torch.Tensor]):
        from transformers import DynamicCache

        cache = DynamicCache(ddp_cache_data=[(past[2 * i], past[2 * i + 1]) for i in range(self.n_layers)])
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         use_cache=True, **{self.cache_kw: cache})
        present = []
        for layer in out.past_key_values.layers:
            present += [layer.keys, layer.values]
        return (out.logits, *present)


def dequantized_copy(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """A copy of ``model`` in ``dtype`` whose QuantLinear layers are nn.Linear with the dequantized weights."""
    model = copy.deepcopy(model)
    for name, m in [(n, m) for n, m in model.named_modules() if isinstance(m, QuantLinear)]:
        lin = nn.Linear(m.in_features, m.out_features, bias=m.bias is not None)
        lin.weight.data = m.dequantized_weight(torch.float32)
        if m.bias is not None:
            lin.bias.data = m.bias.data.float()
        set_module(model, name, lin)
    return model.to(dtype).eval()


def sample_inputs(config, dtype: torch.dtype, batch: int = 2, seq: int = 3, past: int = 4):
    """Trace inputs; sizes other than 0/1 so that torch.export keeps every length symbolic."""
    heads, head_dim = kv_shape(config)
    ids = torch.randint(0, config.vocab_size, (batch, seq))
    mask = torch.ones(batch, past + seq, dtype=torch.int64)
    pos = torch.arange(past, past + seq).expand(batch, seq).contiguous()
    kv = [torch.zeros(batch, heads, past, head_dim, dtype=dtype) for _ in range(2 * config.num_hidden_layers)]
    return ids, mask, pos, kv


def export_decoder(model: nn.Module, path: Path, dtype: torch.dtype, translations: dict | None = None,
                   metadata: dict[str, str] | None = None) -> None:
    """Trace ``model`` (already in ``dtype``) with the dynamo exporter and save it at ``path``."""
    from torch.export import Dim

    config = model.config
    n = config.num_hidden_layers
    wrapper = KVCacheDecoder(model).eval()
    args = sample_inputs(config, dtype)
    batch, seq, past = Dim("batch_size"), Dim("sequence_length"), Dim("past_sequence_length")
    dynamic = {"input_ids": {0: batch, 1: seq}, "attention_mask": {0: batch, 1: Dim.AUTO},
               "position_ids": {0: batch, 1: seq}, "past": [{0: batch, 2: past} for _ in range(2 * n)]}
    with torch.no_grad():
        program = torch.onnx.export(wrapper, args, dynamo=True, dynamic_shapes=dynamic, opset_version=OPSET,
                                    input_names=input_names(n), output_names=output_names(n),
                                    custom_translation_table=translations, verbose=False)
    for node in program.model.graph:  # drop per-node trace info (local source paths, stack traces)
        node.metadata_props.clear()
    program.model.metadata_props.update(metadata or {})
    program.save(str(path))


def write_onnx(source: Source, folder: Path, dtype: torch.dtype, fmt: str,
               prepare: Callable[[nn.Module, torch.dtype], nn.Module], translations: dict | None = None) -> None:
    """Shared by the ONNX formats: check the family, prepare the module, trace it, write the side files."""
    check_onnx_architecture(source.model_type, fmt)
    model = prepare(source.model, dtype)
    meta = {"compress.format": fmt, "compress.dtype": str(dtype).removeprefix("torch.")}
    export_decoder(model, folder / MODEL_FILE, dtype, translations, meta)
    write_side_files(folder, source, export_config(source.model, dtype, None, source.tables))


def write(source: Source, folder: Path, dtype: torch.dtype) -> None:
    write_onnx(source, folder, dtype, "onnx", dequantized_copy)
