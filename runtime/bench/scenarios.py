"""Side-by-side serving benchmark: transformers ``generate`` vs this engine, static vs continuous
batching, speculative decoding on and off, an fp32 baseline vs the model under test.

Every scenario runs the same kind of synthetic workload: ``n`` requests whose prompt and output
lengths are drawn from ``[len * (1 - jitter), len]`` (real traffic is ragged, which is what makes
static batching and static KV preallocation wasteful). Outputs ignore EOS so lengths are exact.
Per request we time TTFT and TPOT (runtime/bench/timing.py, the one measurement core); a
row reports their medians, the useful output tokens per second of wall time, and KV-cache token
slots allocated vs holding a token (the waste). The speculative rows use prompt-grounded requests
(asked to repeat a passage they contain), where n-gram drafting has something to find.
"""
from __future__ import annotations

import gc
import logging
import random
import time
from dataclasses import asdict, dataclass, replace

from runtime.bench.timing import Row, RunResult, StepClock, run_engine, summarize
from runtime.bench.workload import Request, make_requests

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BenchConfig:
    model: str
    baseline: str | None = None  # fp model for the transformers and engine-fp32 rows; default: model
    prompt_len: int = 128
    output_len: int = 128
    concurrency: tuple[int, ...] = (1, 8, 32)
    requests_per_level: int | None = None  # default: max(4, 2 * concurrency)
    jitter: float = 0.5
    repeats: int = 1  # runs per row; a row reports the median over runs
    hf: bool = True
    speculative: bool = True
    num_speculative_tokens: int = 4
    kv_cache_memory: int = 1 << 30
    max_model_len: int | None = None
    dtype: str = "auto"  # the engine on ``model``; transformers and the engine on ``baseline`` stay fp32
    lm_head: str = "auto"  # the engine on ``model`` (EngineConfig.lm_head)
    kv_cache_dtype: str = "auto"  # the engine on ``model`` (EngineConfig.kv_cache_dtype)
    seed: int = 0

    def __post_init__(self):
        if self.prompt_len < 2 or self.output_len < 2:
            raise ValueError(f"prompt_len={self.prompt_len} and output_len={self.output_len} must both be >= 2")
        if not self.concurrency or min(self.concurrency) < 1:
            raise ValueError(f"concurrency={self.concurrency} must list levels >= 1, e.g. 1,8,32")
        if not 0.0 <= self.jitter < 1.0:
            raise ValueError(f"jitter={self.jitter} must be in [0, 1)")
        if self.repeats < 1:
            raise ValueError(f"repeats={self.repeats} must be >= 1")

    def num_requests(self, concurrency: int) -> int:
        return self.requests_per_level or max(4, 2 * concurrency)


def run_hf(model, requests: list[Request], batch_size: int, pad_id: int) -> RunResult:
    """Static batches of ``batch_size`` (1: sequential). A batch decodes until its longest request is done."""
    import torch

    res = RunResult([], [], 0, 0.0)
    start = time.perf_counter()
    for i in range(0, len(requests), batch_size):
        batch = requests[i:i + batch_size]
        width, new = max(len(r.prompt_ids) for r in batch), max(r.output_len for r in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, r in enumerate(batch):  # left padding, as decoder-only batched generation needs
            ids[row, width - len(r.prompt_ids):] = torch.tensor(r.prompt_ids)
            mask[row, width - len(r.prompt_ids):] = 1
        clock = StepClock()
        t0 = time.perf_counter()
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                           streamer=clock, pad_token_id=pad_id)
        steps = clock.steps
        assert len(steps) >= new, (len(steps), new)
        for r in batch:
            res.ttft.append(steps[0] - t0)
            res.tpot.append((steps[r.output_len - 1] - steps[0]) / (r.output_len - 1))
            res.output_tokens += r.output_len
        # KV slots summed over decode steps: every row holds the padded width plus every step so far,
        # while a request only needs its own prompt plus the tokens it asked for
        for t in range(1, new + 1):
            res.slots_allocated += len(batch) * (width + t)
            res.slots_used += sum(len(r.prompt_ids) + min(t, r.output_len) for r in batch)
    res.wall = time.perf_counter() - start
    return res


def _engine_classes():
    from runtime.config import EngineConfig
    from runtime.engine import Engine
    from runtime.sequence import SamplingParams

    return Engine, EngineConfig, SamplingParams


def _build_engine(cfg: BenchConfig, model: str, max_seqs: int, draft: str | None, dtype: str = "float32",
                  lm_head: str = "fp", kv_cache_dtype: str = "auto"):
    Engine, EngineConfig, _ = _engine_classes()
    return Engine(EngineConfig(model=model, dtype=dtype, max_num_seqs=max_seqs, kv_cache_memory=cfg.kv_cache_memory,
                               max_model_len=cfg.max_model_len, draft=draft,
                               num_speculative_tokens=cfg.num_speculative_tokens, seed=cfg.seed, lm_head=lm_head,
                               kv_cache_dtype=kv_cache_dtype))


def _check_servable(*specs: str) -> None:
    """Each model's checkpoint opens and the runtime has a path for its family, from the config alone."""
    from runtime.models.dispatch import model_config
    from runtime.models.loader import open_checkpoint

    for spec in dict.fromkeys(specs):
        model_config(open_checkpoint(spec))


class _Runs:
    """One run_bench call: its config, the seeded prompt offsets, the progress callback, the rows so far."""

    def __init__(self, cfg: BenchConfig, say):
        self.cfg, self.say = cfg, say
        self.rows: list[Row] = []
        self.rng = random.Random(cfg.seed)
        self.sampling_params = _engine_classes()[2]

    def workload(self, tokenizer, c: int, grounded: bool = False) -> list[Request]:
        # a fresh offset per run: no two runs share prompts, so prefix caching cannot skip work across rows
        cfg = self.cfg
        return make_requests(tokenizer, cfg.num_requests(c), cfg.prompt_len, cfg.output_len, cfg.jitter,
                             seed=self.rng.randrange(1 << 30), grounded=grounded)

    def engine_rows(self, engine, model: str, label: str, static_too: bool, grounded: bool = False) -> None:
        cfg, sp = self.cfg, self.sampling_params
        warm = self.workload(engine.tokenizer, 1)[:1]
        run_engine(engine, [replace(warm[0], output_len=2)], 1, False, sp)  # first-call costs out
        for c in cfg.concurrency:
            for static in ((True, False) if static_too else (False,)):
                name = f"{label}-{'static' if static else 'continuous'}"
                self.say(f"{name} c={c}")
                runs = [run_engine(engine, self.workload(engine.tokenizer, c, grounded), c, static, sp)
                        for _ in range(cfg.repeats)]
                self.rows.append(summarize(name, model, c, runs))

    def hf_rows(self, base: str) -> None:
        """transformers generate on the fp model: sequential, then a static batch per level above 1."""
        from compress.format.models import load_model

        cfg = self.cfg
        model, tok, _ = load_model(base)
        model = model.float().eval()
        pad = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
        warm = self.workload(tok, 1)[:1]
        run_hf(model, [replace(warm[0], output_len=2)], 1, pad)
        self.say("hf-generate batch 1")
        self.rows.append(summarize("hf-generate-seq", base, 1,
                                   [run_hf(model, self.workload(tok, 1), 1, pad) for _ in range(cfg.repeats)]))
        for c in cfg.concurrency:
            if c > 1:
                self.say(f"hf-generate static batch {c}")
                self.rows.append(summarize("hf-generate-static", base, c,
                                           [run_hf(model, self.workload(tok, c), c, pad) for _ in range(cfg.repeats)]))
        del model
        gc.collect()

    def model_rows(self) -> dict:
        """The engine on the model under test: static and continuous, then grounded with and without n-gram
        speculation; returns the last engine's stats."""
        cfg, top = self.cfg, max(self.cfg.concurrency)
        engine = _build_engine(cfg, cfg.model, top, None, cfg.dtype, cfg.lm_head, cfg.kv_cache_dtype)
        tag = {"float32": "", "bfloat16": "-bf16", "float16": "-fp16"}[engine.dtype]
        tag += "" if cfg.kv_cache_dtype == "auto" else f"-kv{cfg.kv_cache_dtype}"
        self.engine_rows(engine, cfg.model, f"engine{tag}", static_too=True)
        if cfg.speculative:
            self.engine_rows(engine, cfg.model, f"engine{tag}-grounded", static_too=False, grounded=True)
            del engine
            gc.collect()
            engine = _build_engine(cfg, cfg.model, top, "ngram", cfg.dtype, cfg.lm_head, cfg.kv_cache_dtype)
            self.engine_rows(engine, cfg.model, f"engine{tag}-ngram-spec-grounded", static_too=False, grounded=True)
        stats = engine.stats()
        del engine
        gc.collect()
        return stats


def run_bench(cfg: BenchConfig, progress=None) -> dict:
    """Run every scenario; returns ``{"config": ..., "rows": [...]}`` (rows as dicts)."""
    base = cfg.baseline or cfg.model
    _check_servable(cfg.model, base)  # minutes of transformers rows are not spent on a model the engine refuses
    runs = _Runs(cfg, progress or (lambda msg: log.info(msg)))
    if cfg.hf:
        runs.hf_rows(base)
    if cfg.baseline and cfg.baseline != cfg.model:
        engine = _build_engine(cfg, base, max(cfg.concurrency), None)
        runs.engine_rows(engine, base, "engine-fp32", static_too=False)
        del engine
        gc.collect()
    stats = runs.model_rows()
    return {"config": {**asdict(cfg), "concurrency": list(cfg.concurrency)}, "engine_stats_at_end": stats,
            "rows": [asdict(r) for r in runs.rows]}


COLUMNS = [("scenario", "scenario", "{}"), ("model", "model", "{}"), ("concurrency", "conc", "{}"),
           ("requests", "reqs", "{}"), ("ttft_ms_p50", "TTFT p50 ms", "{:.1f}"), ("tpot_ms_p50", "TPOT p50 ms", "{:.2f}"),
           ("output_tok_s", "out tok/s", "{:.1f}"), ("kv_waste_pct", "KV waste %", "{:.1f}"),
           ("spec_acceptance_pct", "spec acc %", "{:.1f}")]


def format_table(rows: list[dict]) -> str:
    """A plain fixed-width table of the rows (missing values shown as '-')."""
    cells = [[h for _, h, _ in COLUMNS]]
    for r in rows:
        r = {**r, "model": r["model"].rstrip("/").rsplit("/", 1)[-1]}  # a folder's name, not its whole path
        cells.append(["-" if r[k] is None else fmt.format(r[k]) for k, _, fmt in COLUMNS])
    widths = [max(len(row[i]) for row in cells) for i in range(len(COLUMNS))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
