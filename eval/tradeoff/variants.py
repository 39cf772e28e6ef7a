"""What a report measures: the fp model, a recipe applied to it, an export of such a checkpoint, an
existing folder/file, or a running server (eval/tradeoff/served.py).
Planning checks every name before any work; materializing runs `compress quantize`
(in a child process, so its time and peak memory are its own) and `compress export` once per variant."""
from __future__ import annotations

import codecs
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from eval.tradeoff.cache import StageCache, digest, fingerprint
from eval.tradeoff.config import FP_NAMES, ReportConfig, parse_export
from eval.tradeoff.served import is_url, served_label_key

FP_LABEL = "fp32"
# --fp-tables: a recipe run again with its embedding and LM head kept full width, the row beside the recipe's own
FP_TABLES = (("embed", "none"), ("head", "none"))
FP_TABLES_SUFFIX = "-fp-tables"
STDERR_TAIL = 4000  # characters of a failed child's stderr kept for its error


@dataclass(frozen=True)
class Variant:
    label: str  # the row's name: fp32, a recipe name, RECIPE.FORMAT, or the folder's name
    kind: str  # "fp" | "recipe" | "export" | "folder" | "served"
    key: str  # hash of what defines it (model, recipe config, format, or the folder's files)
    recipe: str | None = None
    fmt: str | None = None
    path: str | None = None  # kind "folder": the given path; "served": the server's root URL
    overrides: tuple[tuple[str, str], ...] = ()  # kind "recipe": recipe fields this row changes (FP_TABLES)

    @property
    def slug(self) -> str:
        return f"{self.label}-{self.key}"


def recipe_config(recipe: str, cfg: ReportConfig, overrides: tuple[tuple[str, str], ...] = ()):
    """The recipe's QuantizeConfig with the report's calibration overrides and the row's own ``overrides``
    (unknown recipe: FileNotFoundError)."""
    from compress.config import load_recipe

    return load_recipe(recipe).replace(nsamples=cfg.calib_nsamples, seqlen=cfg.calib_seqlen, **dict(overrides))


def _recipe_variants(recipe: str, cfg: ReportConfig, model_id: list) -> list[Variant]:
    """The recipe's row, and with ``cfg.fp_tables`` the same recipe with full-width tables beside it when the recipe
    quantizes its embedding or head (the size and quality those account for)."""
    qc = recipe_config(recipe, cfg)
    out = [Variant(Path(recipe).stem, "recipe", digest([model_id, qc.to_dict()]), recipe=recipe)]
    if cfg.fp_tables and (qc.embed != "none" or qc.head != "none"):
        full = recipe_config(recipe, cfg, FP_TABLES)
        out.append(Variant(Path(recipe).stem + FP_TABLES_SUFFIX, "recipe", digest([model_id, full.to_dict()]),
                           recipe=recipe, overrides=FP_TABLES))
    return out


def model_identity(spec: str) -> list:
    from compress.format.models import resolve

    src = resolve(spec)  # a missing model is a FileNotFoundError naming what was expected
    return [spec, fingerprint(src.path / src.gguf_file if src.gguf_file else src.path)]


def _folder_variant(p: str) -> Variant:
    from compress.exporters.onnx_runner import is_onnx_folder

    path = Path(p)
    if not path.exists():
        raise FileNotFoundError(f"--variants {p}: no such folder or file")
    ok = (path.is_file() and path.suffix == ".gguf") or (path.is_dir() and (
        is_onnx_folder(path) or (path / "config.json").is_file()))
    if not ok:
        raise ValueError(f"--variants {p}: expected a checkpoint folder (config.json), an ONNX export folder "
                         "or a .gguf file")
    return Variant(path.name, "folder", digest(fingerprint(path)), path=str(path))


def _given_variant(p: str, cfg: ReportConfig) -> Variant:
    """A --variants entry: a server URL (reached now) or a folder/file."""
    if not is_url(p):
        return _folder_variant(p)
    label, root, identity = served_label_key(p, cfg.api_key)
    return Variant(label, "served", digest(identity), path=root)


def plan(cfg: ReportConfig) -> list[Variant]:
    """Every variant of the report, in order; raises on an unknown recipe or a missing folder before any work."""
    model_id = model_identity(cfg.model)
    out: list[Variant] = []
    for r in cfg.recipes:
        if r in FP_NAMES:
            out.append(Variant(FP_LABEL, "fp", digest(model_id)))
        else:
            out += _recipe_variants(r, cfg, model_id)
    for e in cfg.exports:
        fmt, r = parse_export(e)
        base = digest([model_id, recipe_config(r, cfg).to_dict()])
        out.append(Variant(f"{Path(r).stem}.{fmt}", "export", digest([base, fmt]), recipe=r, fmt=fmt))
    out += [_given_variant(p, cfg) for p in cfg.variants]
    labels = [v.label for v in out]
    dup = sorted({x for x in labels if labels.count(x) > 1})
    if dup:
        raise ValueError(f"variant name(s) {', '.join(dup)} given twice: each row needs its own name")
    return out


def _run_quantize(recipe: str, cfg: ReportConfig, out: Path, json_path: Path, echo: bool,
                  overrides: tuple[tuple[str, str], ...] = ()) -> None:
    """`compress quantize` in a child process (``overrides`` as its flags); its stderr (the block bar) is shown
    unless quiet."""
    cmd = [sys.executable, "-m", "cli", "quantize", "--recipe", recipe, "--model", cfg.model, "--out", str(out),
           "--overwrite", "--json", str(json_path)]
    for key, value in overrides:
        cmd += [f"--{key.replace('_', '-')}", value]
    if cfg.calib_nsamples:
        cmd += ["--nsamples", str(cfg.calib_nsamples)]
    if cfg.calib_seqlen:
        cmd += ["--seqlen", str(cfg.calib_seqlen)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    tail, text = "", codecs.getincrementaldecoder("utf-8")("replace")  # a bar's blocks may straddle reads
    try:  # os.read returns whatever the child has written so far: its bar redraws as it goes
        for raw in iter(lambda: os.read(proc.stderr.fileno(), 4096), b""):
            chunk = text.decode(raw)
            tail = (tail + chunk)[-STDERR_TAIL:]
            if echo:
                sys.stderr.write(chunk)
    except BaseException:  # an interrupted report (Ctrl-C) takes its child with it
        proc.kill()
        raise
    if proc.wait() != 0:
        lines = [x for x in tail.replace("\r", "\n").splitlines() if x.strip()]
        raise RuntimeError(f"compress quantize --recipe {recipe} failed: {lines[-1] if lines else proc.returncode}")


class Materializer:
    """Makes each variant's artifact under ``OUT/variants`` once (quantize, then export) and says where it is."""

    def __init__(self, cfg: ReportConfig, cache: StageCache, note: Callable[[str], None], echo: bool = True):
        self.cfg, self.cache, self.note, self.echo = cfg, cache, note, echo
        self.root = Path(cfg.out) / "variants"

    def source(self, v: Variant) -> tuple[str, dict]:
        """(model spec or path to measure, {"quantize": ..., "export": ...} facts of how it was made)."""
        if v.kind == "fp":
            return self.cfg.model, {}
        if v.kind in ("folder", "served"):
            return v.path, {}
        base = v if v.kind == "recipe" else Variant(
            Path(v.recipe).stem, "recipe", digest([model_identity(self.cfg.model),
                                                   recipe_config(v.recipe, self.cfg).to_dict()]), v.recipe)
        ckpt, facts = self._quantized(base)
        if v.kind == "recipe":
            return ckpt, facts
        return self._exported(v, ckpt, facts)

    def _quantized(self, v: Variant) -> tuple[str, dict]:
        folder = self.root / v.slug

        def quantize() -> dict:
            flags = "".join(f" --{k.replace('_', '-')} {x}" for k, x in v.overrides)
            self.note(f"{v.label}: compress quantize --recipe {v.recipe}{flags}")
            folder.parent.mkdir(parents=True, exist_ok=True)
            for stale in folder.parent.glob(f".{v.slug}.tmp-*"):  # left by a killed run's child
                shutil.rmtree(stale, ignore_errors=True)
            json_path = folder.parent / f".{v.slug}.quantize.json"
            _run_quantize(v.recipe, self.cfg, folder, json_path, self.echo, v.overrides)
            res = json.loads(json_path.read_text())
            json_path.unlink()
            return {"seconds": res["seconds"], "peak_rss_bytes": res["peak_rss_bytes"],
                    "quantize_seconds": res["report"]["seconds"], "fp_bytes": res["fp_bytes"]}

        if not (folder / "config.json").is_file():  # the folder is renamed into place whole, or not at all
            self.cache.path(v.slug, "quantize", v.key).unlink(missing_ok=True)
        facts = self.cache.run(v.slug, "quantize", v.key, quantize)
        return str(folder), {"quantize": facts}

    def _exported(self, v: Variant, ckpt: str, facts: dict) -> tuple[str, dict]:
        from compress.exporters.dispatch import export

        target = self.root / (f"{v.slug}.gguf" if v.fmt == "gguf" else v.slug)

        def run() -> dict:
            self.note(f"{v.label}: compress export --format {v.fmt}")
            t0 = time.perf_counter()
            # the row measures what the format holds: a table it has no codes for counts at full width
            export(ckpt, v.fmt, target, overwrite=True, dequantize_embedding=True)
            return {"seconds": time.perf_counter() - t0}

        if not target.exists():
            self.cache.path(v.slug, "export", v.key).unlink(missing_ok=True)
        return str(target), {**facts, "export": self.cache.run(v.slug, "export", v.key, run)}
