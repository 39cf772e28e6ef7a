"""`compress export`: one plain dict from format name to its exporter, and the checks every format shares."""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from compress.checkpoint import atomic_dir
from compress.export import awq, compressed_tensors, gptq, onnx_fp, onnx_int4
from compress.export.common import DTYPES, Source, load_source
from compress.qlinear import QuantLinear

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ExportFormat:
    """An exporter writes ``source`` into an empty folder; ``check`` says why a layer cannot be carried."""

    write: Callable[[Source, Path, torch.dtype], None]
    check: Callable[[QuantLinear], str | None] | None  # None: carries any layer (dequantized)
    quantized_only: bool
    default_dtype: str


FORMATS: dict[str, ExportFormat] = {
    "compressed-tensors": ExportFormat(compressed_tensors.write, compressed_tensors.check, True, "float16"),
    "gptq": ExportFormat(gptq.write, gptq.check, True, "float16"),
    "awq": ExportFormat(awq.write, awq.check, True, "float16"),
    "onnx": ExportFormat(onnx_fp.write, None, False, "float32"),
    "onnx-int4": ExportFormat(onnx_int4.write, onnx_int4.check, True, "float32"),
}


def carriers(m: QuantLinear) -> list[str]:
    """The integer formats that can carry this layer as it is."""
    return [name for name, f in FORMATS.items() if f.check is not None and f.check(m) is None]


def check_layers(source: Source, fmt: str) -> None:
    """Refuse, naming the first offending layer and the formats that could carry it."""
    check = FORMATS[fmt].check
    if check is None:
        return
    bad = [(name, why) for name, m in source.qmodules.items() if (why := check(m)) is not None]
    if not bad:
        return
    name, why = bad[0]
    others = carriers(source.qmodules[name])
    can = ", ".join(others) if others else "none of the integer formats"
    raise ValueError(f"--format {fmt} cannot carry {name} ({why}; {len(bad)} layer(s) affected). "
                     f"Formats that can: {can}; `--format onnx` exports the dequantized weights, "
                     "and the compress folder itself keeps them as they are")


def export(spec: str, fmt: str, out: str | Path, overwrite: bool = False, dtype: str | None = None) -> Path:
    """Export the model ``spec`` (a compress quantized folder, an HF folder or a model name) as ``fmt``."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown export format {fmt!r}; use one of: {', '.join(FORMATS)}")
    dtype = dtype or FORMATS[fmt].default_dtype
    if dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r} is not supported; use one of: {', '.join(DTYPES)}")
    out = Path(out)
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} already exists; pass --overwrite to replace it")
    source = load_source(spec)
    if source.path is not None and out.resolve() == source.path.resolve():
        raise ValueError(f"--out {out} is the model folder itself; choose another output folder")
    if FORMATS[fmt].quantized_only and not source.quantized:
        raise ValueError(f"--format {fmt} needs a quantized model and {spec} has no quantized layers; "
                         "run `compress quantize` first, or use --format onnx for a floating-point export")
    check_layers(source, fmt)
    log.info("exporting %s (%d quantized layers) as %s, %s", spec, len(source.qmodules), fmt, dtype)
    with atomic_dir(out, overwrite=overwrite) as tmp:
        FORMATS[fmt].write(source, tmp, DTYPES[dtype])
    return out
