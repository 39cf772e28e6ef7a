"""What every exporter shares: the loaded source, its fp tensors, its config and its side files."""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch
from torch import Tensor, nn

from compress.format.checkpoint import quantized_modules
from compress.format.families import require
from compress.format.qlinear import QuantLinear
from compress.format.quant import QuantizedWeight, unpack

log = logging.getLogger(__name__)


@dataclass
class Source:
    """A model to export: the torch module (QuantLinear layers when quantized), its tokenizer and path."""

    model: nn.Module
    tokenizer: object | None
    path: Path | None

    @property
    def qmodules(self) -> dict[str, QuantLinear]:
        return quantized_modules(self.model)

    @property
    def quantized(self) -> bool:
        return bool(self.qmodules)

    @property
    def model_type(self) -> str:
        return self.model.config.model_type

    @cached_property
    def tables(self) -> Tables:
        """The checkpoint's quantized embedding and LM head, read once (none for a floating-point source)."""
        return read_tables(self.path, self.model.config.hidden_size)


@dataclass(frozen=True)
class QuantizedTable:
    """A quantized embedding or LM head as the checkpoint stores it: ``name``'s QuantLinear-layout tensors as
    codes (``weight.q``: [rows, hidden]); ``tied``: a head that reads the embedding's tensors."""

    name: str
    weight: QuantizedWeight
    tied: bool = False


@dataclass(frozen=True)
class Tables:
    """``quantization_config["embed"]`` and ``["head"]`` (absent or null: that table is not quantized). An untied
    quantized head is also listed in ``modules`` (a QuantLinear in the loaded model); a tied one stores no tensors."""

    embed: QuantizedTable | None = None
    head: QuantizedTable | None = None

    @property
    def owners(self) -> set[str]:
        """Module names whose state-dict entries the quantized tables replace."""
        return {t.name for t in (self.embed, self.head) if t is not None}

    def flags(self) -> str:
        """The quantize flags that keep these tables full width, for refusals."""
        return " ".join(f"--{k} none" for k, t in (("embed", self.embed), ("head", self.head)) if t is not None)


def read_tables(path: Path | None, hidden: int) -> Tables:
    """The one reader of the checkpoint's ``embed``/``head`` entries and their tensors (every exporter uses it)."""
    cfg = path / "config.json" if path is not None else None
    if cfg is None or not cfg.is_file():
        return Tables()
    qc = json.loads(cfg.read_text()).get("quantization_config") or {}
    embed_entry, head_entry = qc.get("embed"), qc.get("head")
    if qc.get("quant_method") != "compress" or not (embed_entry or head_entry):
        return Tables()
    embed = _read_table(path, embed_entry, hidden) if embed_entry else None
    head = None
    if head_entry and head_entry.get("tied"):
        if embed is None:
            raise ValueError(f"{path}: quantization_config['head'] is tied but no quantized embedding is recorded")
        head = QuantizedTable(head_entry["name"], embed.weight, tied=True)
    elif head_entry:
        head = _read_table(path, head_entry, hidden)
    return Tables(embed, head)


def _read_table(path: Path, entry: dict, hidden: int) -> QuantizedTable:
    from safetensors import safe_open

    from compress.format.checkpoint import scheme_of
    from compress.format.shards import shard_files

    name, scheme = entry["name"], scheme_of(entry)
    keys = {f"{name}.{k}" for k in ("qweight", "scales", "qzeros")}
    found: dict[str, torch.Tensor] = {}
    for f in shard_files(path):
        with safe_open(str(f), framework="pt") as st:
            found.update({k: st.get_tensor(k) for k in keys & set(st.keys())})
    missing = {f"{name}.qweight", f"{name}.scales"} - set(found)
    if missing or scheme.has_zeros != (f"{name}.qzeros" in found):
        raise ValueError(f"{path}: the quantized {name} recorded in quantization_config lacks tensors "
                         f"{sorted(missing) or [f'{name}.qzeros']}")
    q = unpack(found[f"{name}.qweight"], scheme.bits, hidden)  # [rows, words] -> codes [rows, hidden]
    return QuantizedTable(name, QuantizedWeight(q, found[f"{name}.scales"], found.get(f"{name}.qzeros"), scheme))


def load_source(spec: str) -> Source:
    """Load a compress quantized folder, a plain HF folder or an embedded model name, in float32."""
    from compress.format.models import load_model

    model, tokenizer, src = load_model(spec, dtype=torch.float32, dequantize_tables=True)  # codes: read_tables
    return Source(model.eval(), tokenizer, src.path)


def check_onnx_architecture(model_type: str, fmt: str) -> None:
    require(model_type, "onnx")


def tied_lm_head(model: nn.Module) -> bool:
    """True when lm_head shares the embedding matrix (and is not itself quantized)."""
    head = model.get_output_embeddings()
    emb = model.get_input_embeddings()
    return (head is not None and not isinstance(head, QuantLinear) and emb is not None
            and head.weight is getattr(emb, "weight", None))  # a QuantEmbedding has codes, no weight


def fp_tensors(model: nn.Module, dtype: torch.dtype, tables: Tables | None = None,
               dequantize_embed: bool = True) -> dict[str, Tensor]:
    """Every tensor of the state dict that is not a QuantLinear's integers/scales, floats cast to ``dtype``.

    QuantLinear biases are kept (``P.bias``); a tied lm_head is left out, as save_pretrained does. A quantized
    embedding (``tables``) is left out too, or, with ``dequantize_embed``, written as ``E.weight`` dequantized
    to ``dtype`` (for formats that cannot carry its codes: the checkpoint's values, not its size).
    """
    tables = tables or Tables()
    qnames = set(quantized_modules(model))
    skip_head = tied_lm_head(model) or (tables.head is not None and tables.head.tied)
    head_name = next((n for n, m in model.named_modules() if m is model.get_output_embeddings()), None)
    embed_name = tables.embed.name if tables.embed is not None else None
    out = {}
    for key, t in model.state_dict().items():
        owner, _, leaf = key.rpartition(".")
        if owner in qnames and leaf != "bias":
            continue
        if (skip_head and owner == head_name) or owner == embed_name:
            continue
        t = t.detach()
        out[key] = (t.to(dtype) if t.is_floating_point() else t).contiguous().clone()
    if tables.embed is not None and dequantize_embed:
        log.info("%s is quantized in the checkpoint and this format cannot carry its codes: written dequantized "
                 "as %s (the checkpoint's values, at full width)", embed_name, str(dtype).removeprefix("torch."))
        out[f"{embed_name}.weight"] = tables.embed.weight.dequantize(dtype).contiguous()
    return out


def export_config(model: nn.Module, dtype: torch.dtype, quantization_config: dict | None,
                  tables: Tables | None = None) -> dict:
    """The model's config.json with the target dtype and the target format's quantization_config (a head tied to
    a quantized embedding stays tied, whatever module the loader gave it)."""
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)
    cfg["torch_dtype"] = cfg["dtype"] = str(dtype).removeprefix("torch.")
    tied = tied_lm_head(model) or (tables is not None and tables.head is not None and tables.head.tied)
    if not tied and getattr(model.config, "tie_word_embeddings", False):
        cfg["tie_word_embeddings"] = False  # lm_head is stored on its own (quantized or untied)
    if quantization_config is not None:
        cfg["quantization_config"] = quantization_config
    return cfg


def write_side_files(folder: Path, source: Source, config: dict) -> None:
    """config.json, generation_config.json and the tokenizer beside the weights."""
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    gen = getattr(source.model, "generation_config", None)
    if gen is not None:
        gen.save_pretrained(folder)
    if source.tokenizer is not None:
        source.tokenizer.save_pretrained(folder)


def save_safetensors(tensors: dict[str, Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata={"format": "pt"})


def group_map(m: QuantLinear) -> Tensor:
    """The group of each input column: the stored act-order ``g_idx`` or natural order (ragged last)."""
    if m.g_idx is not None:
        return m.g_idx.long()
    return torch.arange(m.in_features) // m.scheme.group(m.in_features)


def zeros_of(m: QuantLinear) -> Tensor:
    """Integer zero points [out, G] (symmetric schemes: the implicit ``2**(bits-1)``)."""
    if m.qzeros is not None:
        return m.qzeros.to(torch.int64)
    return torch.full(m.scales.shape, m.scheme.sym_zero, dtype=torch.int64)


def is_ragged(m: QuantLinear) -> bool:
    return m.in_features % m.scheme.group(m.in_features) != 0


def fp_linear_names(model: nn.Module) -> list[str]:
    """nn.Linear layers that stay in floating point."""
    return sorted(n for n, mod in model.named_modules() if isinstance(mod, nn.Linear))
