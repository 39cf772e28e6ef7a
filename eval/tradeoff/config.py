"""The report's settings, validated at the edge, and how variants are named on the command line."""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field

FP_NAMES = ("fp", "fp32")  # the model itself, unquantized
DEFAULT_RECIPES = ("fp32", "int8", "nf4", "rtn4", "gptq4", "awq4", "awq-gptq4")
EXPORT_FORMATS = ("onnx", "onnx-int4", "gguf")  # the exports a report can measure (own runtime each)
_UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_size(text: str) -> int:
    """'120MB', '100MiB', '0.2GB' or a plain byte count -> bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text or "")
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"--max-size {text!r}: give a size such as 120MB, 100MiB or 0.2GB")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def parse_export(text: str) -> tuple[str, str]:
    """'onnx-int4:rtn4' -> ('onnx-int4', 'rtn4'): FORMAT of the checkpoint a recipe makes."""
    fmt, sep, recipe = text.partition(":")
    if not sep or fmt not in EXPORT_FORMATS or not recipe:
        raise ValueError(f"--exports {text!r}: give FORMAT:RECIPE with FORMAT one of {', '.join(EXPORT_FORMATS)}, "
                         "e.g. onnx-int4:rtn4 or gguf:gptq4")
    return fmt, recipe


@dataclass(frozen=True)
class ReportConfig:
    """Everything a report measures and how; each stage's cache key is built from the fields it reads."""

    model: str
    out: str
    recipes: tuple[str, ...] = DEFAULT_RECIPES
    variants: tuple[str, ...] = ()  # existing folders or files (checkpoint, ONNX export, .gguf) or server URLs
    exports: tuple[str, ...] = ()  # FORMAT:RECIPE
    ppl: tuple[str, ...] = ("wiki",)
    seqlen: int = 512
    max_windows: int | None = 32
    tasks: tuple[str, ...] = ()
    limit: int | None = None
    batch_size: int = 8
    speed: bool = True
    concurrency: int = 8
    prompt_len: int = 128
    output_len: int = 64
    calib_nsamples: int | None = None  # override the recipes' calibration windows (None: the recipe's)
    calib_seqlen: int | None = None
    max_size: int | None = None  # bytes; None: 30% of the baseline's size
    max_ppl_increase: float = 5.0  # percent over the baseline's perplexity
    # each recipe that quantizes the embedding/LM head also run with them full width (embed/head none), beside it
    fp_tables: bool = False
    api_key: str | None = field(default=None, repr=False)  # of the servers in ``variants``; never written out

    def __post_init__(self):
        if not (self.recipes or self.variants or self.exports):
            raise ValueError("nothing to report: give --recipes, --variants or --exports")
        if not self.ppl:
            raise ValueError("--ppl names no text: give at least one, e.g. wiki")
        for name, value in (("seqlen", self.seqlen), ("batch_size", self.batch_size),
                            ("concurrency", self.concurrency), ("prompt_len", self.prompt_len),
                            ("output_len", self.output_len)):
            if value < 2 and not (name in ("batch_size", "concurrency") and value == 1):
                raise ValueError(f"--{name.replace('_', '-')} {value} is too small")
        for name in ("max_windows", "limit", "calib_nsamples", "calib_seqlen", "max_size"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"--{name.replace('_', '-')} {value} must be at least 1")
        if self.max_ppl_increase < 0:
            raise ValueError(f"--max-ppl-increase {self.max_ppl_increase} must be >= 0 (percent)")
        for e in self.exports:
            parse_export(e)

    def to_dict(self) -> dict:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items() if k != "api_key"}
