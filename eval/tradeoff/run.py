"""`compress report` from start to end: plan and check every variant, make and measure each one (cached
per stage, a failure kept in its row), then the frontier, the recommendations and the files."""
from __future__ import annotations

import gc
import json
import logging
import os
import time
from pathlib import Path

from eval.progress import Bars
from eval.tradeoff import pareto, plots, render
from eval.tradeoff.cache import StageCache, digest, write_atomic, write_atomic_bytes
from eval.tradeoff.config import ReportConfig
from eval.tradeoff.speed import torch_threads
from eval.tradeoff.variants import Materializer, Variant, model_identity, plan

log = logging.getLogger(__name__)
DEFAULT_BUDGET = 0.3  # --max-size default: this fraction of the baseline's size
PLOT_FILES = ("ppl_vs_size.png", "kl_vs_size.png", "ppl_vs_speed.png")


def check_out(out: Path) -> None:
    """The output folder is new, empty, or an earlier report's (whose cache is reused)."""
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"--out {out} is a file; give a folder")
    if out.is_dir() and any(out.iterdir()) and not ((out / "cache").is_dir() or (out / "report.json").is_file()):
        raise FileExistsError(f"--out {out} holds other files and no earlier report: choose a new or empty folder")


class _Measure:
    """Measures one variant at a time; the fp reference model is loaded once, when first needed."""

    def __init__(self, cfg: ReportConfig, texts: dict, cache: StageCache, bars: Bars, echo: bool):
        self.cfg, self.texts, self.cache, self.bars = cfg, texts, cache, bars
        self.make = Materializer(cfg, cache, bars.note, echo and not bars.quiet)
        self._reference = None
        model_id = model_identity(cfg.model)
        self.quality_key = digest([model_id, cfg.ppl, cfg.seqlen, cfg.max_windows, cfg.tasks, cfg.limit])
        self.speed_key = digest([cfg.concurrency, cfg.prompt_len, cfg.output_len, torch_threads()])

    def reference(self):
        if self._reference is None:
            from compress.format.models import load_model
            from eval.progress import quiet_third_party

            with quiet_third_party():
                self._reference = load_model(self.cfg.model)[0]
        return self._reference

    def _stage(self, row: dict, name: str, v: Variant, key: str, compute) -> None:
        try:
            row[name] = self.cache.run(v.slug, name, digest([v.key, key]), compute)
        except Exception as e:  # one variant's failure is its row's; the others go on
            log.debug("%s: %s failed", v.label, name, exc_info=True)
            row["error"] = "; ".join(x for x in (row.get("error"), f"{name}: {type(e).__name__}: {e}") if x)

    def _quality(self, v: Variant, spec: str) -> dict:
        from eval.tradeoff.quality import measure_quality
        from eval.tradeoff.served import served_quality

        if v.kind == "served":
            return served_quality(spec, self.texts, self.cfg, self.bars)
        ref = None if v.kind == "fp" else self.reference()  # loaded only when a stage is not cached
        return measure_quality(spec, v.kind, self.texts, self.cfg, ref, self.bars, v.label)

    def row(self, v: Variant) -> dict:
        from eval.tradeoff.served import served_speed
        from eval.tradeoff.speed import measure_speed

        row = {"label": v.label, "kind": v.kind, "key": v.key, "recipe": v.recipe, "format": v.fmt, "error": None,
               "overrides": dict(v.overrides)}
        try:
            spec, row["made"] = self.make.source(v)
        except Exception as e:  # a failed quantize or export: recorded, and the next variant goes on
            row["error"] = f"make: {type(e).__name__}: {e}"
            return row
        row["source"] = spec
        self._stage(row, "quality", v, self.quality_key, lambda: self._quality(v, spec))
        if self.cfg.speed:
            def speed():
                from eval.progress import quiet_third_party

                self.bars.note(f"{v.label}: speed")
                if v.kind == "served":
                    return served_speed(spec, self.cfg)
                with quiet_third_party():  # transformers' weight-loading bar
                    return measure_speed(spec, self.cfg)
            self._stage(row, "speed", v, self.speed_key, speed)
        gc.collect()
        return row


def _candidates(rows: list[dict], text: str) -> dict[str, pareto.Candidate]:
    """The rows with a size (a served row has none): the frontier's, the plots' and the recommendations'."""
    return {r["label"]: pareto.Candidate(r["label"], r["quality"]["size_bytes"], r["quality"]["ppl"][text],
                                         (r.get("speed") or {}).get("decode_tok_s"))
            for r in rows if r.get("quality") and r["quality"]["size_bytes"] is not None}


def analyse(result: dict, cfg: ReportConfig) -> None:
    """Baseline, Pareto marks and recommendations from the measured rows (in place)."""
    text = cfg.ppl[0]
    cands = _candidates(result["rows"], text)
    base = next((r for r in result["rows"] if r["kind"] == "fp" and r["label"] in cands),
                next((r for r in result["rows"] if r["label"] in cands), None))
    result["baseline"] = base and base["label"]
    result["baseline_ppl"] = base and base["quality"]["ppl"]
    front = set(pareto.frontier({k: (c.size_bytes, c.ppl, -(c.decode_tok_s or 0.0)) for k, c in cands.items()}))
    for r in result["rows"]:
        r["pareto"] = r["label"] in front
    recs = []
    if base:
        b = cands[base["label"]]
        budget = cfg.max_size or DEFAULT_BUDGET * b.size_bytes
        recs = pareto.recommend(list(cands.values()), b, cfg.max_ppl_increase, budget)
    result["recommendations"] = [{"goal": r.goal, "label": r.label, "why": r.why} for r in recs]


def _name(result: dict) -> str:
    return Path(result["model"]).name or result["model"]


def draw(result: dict, cfg: ReportConfig) -> dict[str, bytes]:
    """The plots that have at least two points to show; a folder named MODEL-X is labelled X."""
    text = Path(cfg.ppl[0]).name
    prefix = f"{_name(result)}-"
    cands = {k.removeprefix(prefix) or k: c for k, c in _candidates(result["rows"], cfg.ppl[0]).items()}
    kl = {r["label"].removeprefix(prefix) or r["label"]: r["quality"]["kl"][cfg.ppl[0]]["mean"]
          for r in result["rows"] if r.get("quality") and (r["quality"]["kl"][cfg.ppl[0]] or {}).get("mean", 0) > 0}
    size = [(k, c.size_bytes / 2**20, c.ppl) for k, c in cands.items()]
    series = {
        PLOT_FILES[0]: plots.Series(size, pareto.frontier({k: (x, y) for k, x, y in size}), "size on disk (MiB)",
                                    f"perplexity ({text}, lower is better)", f"{_name(result)}: quality vs size"),
        PLOT_FILES[1]: plots.Series([(k, cands[k].size_bytes / 2**20, v) for k, v in kl.items()],
                                    pareto.frontier({k: (cands[k].size_bytes, v) for k, v in kl.items()}),
                                    "size on disk (MiB)", f"KL divergence to {result['baseline']} (nats/token, mean)",
                                    f"{_name(result)}: KL vs size", logy=True),
        PLOT_FILES[2]: plots.Series([(k, c.decode_tok_s, c.ppl) for k, c in cands.items() if c.decode_tok_s],
                                    pareto.frontier({k: (-c.decode_tok_s, c.ppl) for k, c in cands.items()
                                                     if c.decode_tok_s}),
                                    "batch-1 decode speed (tokens/s, higher is better)",
                                    f"perplexity ({text}, lower is better)", f"{_name(result)}: quality vs speed"),
    }
    return {name: plots.scatter_png(s) for name, s in series.items() if len(s.points) >= 2}


def _machine() -> dict:
    cpu = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return {"cpu": cpu, "cores": len(os.sched_getaffinity(0)), "threads": torch_threads()}


def write_outputs(result: dict, cfg: ReportConfig) -> list[Path]:
    """report.json, report.md, the PNGs and report.html in ``cfg.out``, each written atomically."""
    out = Path(cfg.out)
    pngs = draw(result, cfg)
    paths = []
    for name, png in pngs.items():
        write_atomic_bytes(out / name, png)
        paths.append(out / name)
    for name, text in (("report.json", json.dumps(result, indent=1, default=float)),
                       ("report.md", render.markdown(result, list(pngs))),
                       ("report.html", render.html_page(result, pngs))):
        write_atomic(out / name, text)
        paths.append(out / name)
    return paths


def run_report(cfg: ReportConfig, bars: Bars | None = None, echo: bool = True, command: str = "") -> dict:
    """Measure every variant (reusing cached stages), then write the report; returns report.json's content."""
    from compress.data import load_texts
    from eval.tasks import check_tasks

    bars = bars or Bars(quiet=True)
    check_tasks(list(cfg.tasks))
    out = Path(cfg.out)
    check_out(out)
    variants = plan(cfg)  # an unknown recipe or a missing folder fails here, before any work
    texts = {s: load_texts(s, "eval") for s in cfg.ppl}
    out.mkdir(parents=True, exist_ok=True)
    cache = StageCache(out)
    measure = _Measure(cfg, texts, cache, bars, echo)
    t0 = time.perf_counter()
    rows = []
    for i, v in enumerate(variants):
        bars.note(f"[{i + 1}/{len(variants)}] {v.label}")
        rows.append(measure.row(v))
    windows = next((r["quality"]["windows"] for r in rows if r.get("quality")), 0)
    result = {"model": cfg.model, "command": command, "settings": cfg.to_dict(), "windows": windows,
              "machine": _machine(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "seconds": time.perf_counter() - t0, "cached_stages": cache.hits, "rows": rows}
    analyse(result, cfg)
    write_outputs(result, cfg)
    return result
