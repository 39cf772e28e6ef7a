"""`compress export`: one plain dict from format name to its exporter, and the checks every format shares.

``FORMATS`` is the one list of formats (the CLI's ``--format`` help reads it). Importing this file loads
no exporter, and no torch: each format names its module, imported when the format is used.
"""
from __future__ import annotations

import contextlib
import importlib
import json
import logging
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from compress.exporters.common import Source
    from compress.format.qlinear import QuantLinear

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ExportFormat:
    """The exporter compress/exporters/``module``.py writes a source into an empty folder (or, with ``suffix``, one
    file of that suffix) by ``write(source, out, dtype)`` (with ``options``: ``write(source, out, dtype, options)``,
    ``options`` naming the module's own options type, passed whole); its ``check(layer)``, where it has one, says
    why a layer cannot be carried (without one it carries any layer, dequantized). ``--dtype`` takes ``dtypes``;
    left out, it is the model's own where ``own_dtype`` (and in ``dtypes``), else ``default_dtype``
    (compress/exporters/dtypes.py)."""

    module: str
    quantized_only: bool
    default_dtype: str
    suffix: str | None = None
    options: str | None = None
    dtypes: tuple[str, ...] = ("float32", "float16", "bfloat16")  # compress/exporters/dtypes.py DTYPES
    own_dtype: bool = False
    family_step: str | None = None  # the step of compress/format/families.py that must handle the model type
    experts: bool = False  # carries packed MoE experts
    fp16_probe: bool = True  # float16 only after a float16 forward of the model stays finite
    # a quantized embedding/head (exporters/common.py Tables): "codes" writes both from their own codes (never
    # refused); "layers" carries an untied head as any quantized linear and writes the embedding dequantized
    tables: str = "layers"

    def exporter(self) -> ModuleType:
        return importlib.import_module(f"compress.exporters.{self.module}")

    @property
    def check(self) -> Callable[[QuantLinear], str | None] | None:
        return getattr(self.exporter(), "check", None)

    @property
    def options_type(self) -> type | None:
        return None if self.options is None else getattr(self.exporter(), self.options)


_ONNX = dict(dtypes=("float32", "float16"), family_step="onnx")  # ONNX Runtime's CPU kernels: no bfloat16
FORMATS: dict[str, ExportFormat] = {
    "compressed-tensors": ExportFormat("compressed_tensors", True, "bfloat16", own_dtype=True),
    "gptq": ExportFormat("gptq", True, "bfloat16", own_dtype=True),
    "awq": ExportFormat("awq", True, "bfloat16", own_dtype=True),
    "onnx": ExportFormat("onnx_fp", False, "float32", **_ONNX),
    "onnx-int4": ExportFormat("onnx_int4", True, "float32", **_ONNX),
    # llama.cpp's own default: F16 matrices; it computes activations in fp32, so float16 needs no probe
    "gguf": ExportFormat("gguf", False, "float16", suffix=".gguf", options="GGUFOptions", family_step="gguf",
                         experts=True, fp16_probe=False, tables="codes"),
}


def carriers(m: QuantLinear) -> list[str]:
    """The integer formats that can carry this layer as it is."""
    return [name for name, f in FORMATS.items() if f.check is not None and f.check(m) is None]


def check_experts(source: Source, fmt: str) -> None:
    """Refuse packed MoE experts where the format writes tensors per nn.Linear only."""
    from compress.format.moe_packed import PackedMoEExperts

    packed = [n for n, m in source.model.named_modules() if isinstance(m, PackedMoEExperts)]
    if packed and not FORMATS[fmt].experts:
        can = ", ".join(n for n, f in FORMATS.items() if f.experts)
        raise ValueError(f"--format {fmt} cannot carry {packed[0]} (packed MoE experts, {len(packed)} layer(s); "
                         f"it writes tensors per nn.Linear). Formats that can: {can} (for the families with a GGUF "
                         "architecture in compress/format/families.py); the compress folder keeps them as they are")


def check_layers(source: Source, fmt: str) -> None:
    """Refuse, naming the first offending layer and the formats that could carry it."""
    check = FORMATS[fmt].check
    if check is None:
        return
    tables = source.tables
    own = tables.owners if FORMATS[fmt].tables == "codes" else set()  # the exporter writes these itself
    bad = [(name, why) for name, m in source.qmodules.items() if name not in own and (why := check(m)) is not None]
    if not bad:
        return
    name, why = bad[0]
    others = carriers(source.qmodules[name])
    can = ", ".join(others) if others else "none of the integer formats"
    head = (f"; `compress quantize ... --head none` keeps {name} full width"
            if tables.head is not None and name == tables.head.name else "")
    raise ValueError(f"--format {fmt} cannot carry {name} ({why}; {len(bad)} layer(s) affected). "
                     f"Formats that can: {can}; `--format onnx` exports the dequantized weights, "
                     f"and the compress folder itself keeps them as they are{head}")


def check_embed(source: Source, fmt: str, dequantize: bool) -> None:
    """Refuse a quantized embedding the format cannot carry as codes, unless asked to write it dequantized (the
    checkpoint's values at full width: the export is then that much larger than the checkpoint)."""
    check = getattr(FORMATS[fmt].exporter(), "check_embed", None)
    table = source.tables.embed
    if check is None or table is None or dequantize or (why := check(table.weight)) is None:
        return
    rows, width = table.weight.q.shape
    tied = " and its tied head" if source.tables.head is not None and source.tables.head.tied else ""
    s = table.weight.scheme
    codes = f"{s.bits}-bit {s.format} codes, " + ("per row" if s.group_size == -1 else f"groups of {s.group_size}")
    raise ValueError(f"--format {fmt} cannot carry the quantized embedding {table.name} ({codes}: {why}). Pass --dequantize-embedding to write it{tied} at full width (+{rows * width * 2 / 2**20:,.0f} "
                     "MiB at 16 bits), or quantize with --embed none; gguf and onnx-int4 carry its codes")


@contextlib.contextmanager
def atomic_file(out: Path, overwrite: bool = False):
    """Yield a temporary path beside ``out``; rename it into place only if the block succeeds."""
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} already exists; pass --overwrite to replace it")
    if out.is_dir():
        raise ValueError(f"{out} is a folder; --out names the file to write")
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{out.name}.tmp-", dir=out.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        umask = os.umask(0)
        os.umask(umask)
        tmp.chmod(0o666 & ~umask)  # mkstemp makes the file private
        tmp.replace(out)
    finally:
        tmp.unlink(missing_ok=True)


def export(spec: str, fmt: str, out: str | Path, overwrite: bool = False, dtype: str | None = None,
           options: object | None = None, dequantize_embedding: bool = False) -> Path:
    """Export the model ``spec`` (a compress quantized folder, an HF folder or a model name) as ``fmt``; a
    quantized embedding the format has no codes for is refused unless ``dequantize_embedding``."""
    from compress.format.checkpoint import atomic_dir
    from compress.exporters import dtypes
    from compress.exporters.common import load_source
    from compress.format.families import check_rope, require
    from compress.format.models import declared_dtype, resolve, source_config

    if fmt not in FORMATS:
        raise ValueError(f"unknown export format {fmt!r}; use one of: {', '.join(FORMATS)}")
    f = FORMATS[fmt]
    options_type = f.options_type
    if options is not None and not isinstance(options, options_type or ()):
        raise ValueError(f"--format {fmt} takes no {type(options).__name__}")
    out = Path(out)
    if f.suffix is not None and out.suffix != f.suffix:
        raise ValueError(f"--format {fmt} writes one file: give --out a name ending in {f.suffix}")
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} already exists; pass --overwrite to replace it")
    src = resolve(spec)
    if not src.gguf_file and (src.path / "config.json").is_file():  # before any weight is read
        check_rope(json.loads((src.path / "config.json").read_text()), src.name)
    if f.family_step is not None:
        require(source_config(src).model_type, f.family_step)
    dtype = dtypes.choose(fmt, dtype, declared_dtype(src) if f.own_dtype else None, f.dtypes, f.default_dtype)
    source = load_source(spec)
    if source.path is not None and out.resolve() == source.path.resolve():
        raise ValueError(f"--out {out} is the model folder itself; choose another output folder")
    if f.quantized_only and not source.quantized:
        raise ValueError(f"--format {fmt} needs a quantized model and {spec} has no quantized layers; "
                         "run `compress quantize` first, or use --format onnx for a floating-point export")
    check_experts(source, fmt)
    if getattr(options, "requantize", None) is None:
        check_layers(source, fmt)
    check_embed(source, fmt, dequantize_embedding)
    if dtype == "float16" and f.fp16_probe:
        instead = "bfloat16" if "bfloat16" in f.dtypes else "float32"
        dtypes.require_fp16_safe(source.model, source.tokenizer, fmt, instead)
    log.info("exporting %s (%d quantized layers) as %s, %s", spec, len(source.qmodules), fmt, dtype)
    args = (dtypes.DTYPES[dtype],) if options_type is None else (dtypes.DTYPES[dtype], options or options_type())
    with (atomic_file(out, overwrite) if f.suffix else atomic_dir(out, overwrite=overwrite)) as tmp:
        f.exporter().write(source, tmp, *args)
    return out
