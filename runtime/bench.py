"""Side-by-side serving benchmark: transformers ``generate`` vs this engine, static vs continuous
batching, speculative decoding on and off, an fp32 baseline vs the model under test.

Every scenario runs the same kind of synthetic workload: ``n`` requests whose prompt and output
lengths are drawn from ``[len * (1 - jitter), len]`` (real traffic is ragged, which is what makes
static batching and static KV preallocation wasteful). Outputs ignore EOS so lengths are exact.
Per request we time TTFT (arrival -> first token) and TPOT (mean gap between later tokens); a
row reports their medians, the useful output tokens per second of wall time, and KV-cache token
slots allocated vs holding a token (the waste). The speculative rows use prompt-grounded requests
(asked to repeat a passage they contain), where n-gram drafting has something to find.
"""
from __future__ import annotations

import gc
import logging
import random
import statistics
import time
from collections import deque
from dataclasses import asdict, dataclass, field, replace

from runtime.bench_workload import Request, make_requests

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


@dataclass
class RunResult:
    """One run of one scenario."""

    ttft: list[float]
    tpot: list[float]
    output_tokens: int
    wall: float
    slots_allocated: float = 0.0  # summed over engine steps (time-weighted by step), or static totals
    slots_used: float = 0.0
    spec_drafted: float = 0.0
    spec_accepted: float = 0.0


@dataclass
class Row:
    scenario: str
    model: str
    concurrency: int
    requests: int
    ttft_ms_p50: float | None
    tpot_ms_p50: float | None
    output_tok_s: float
    kv_waste_pct: float | None
    spec_acceptance_pct: float | None
    runs: int = 1
    extra: dict = field(default_factory=dict)


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def summarize(scenario: str, model: str, concurrency: int, runs: list[RunResult]) -> Row:
    """Per run: medians over requests; across runs: the median of each run-level number."""
    def med(f):
        vals = [v for v in (f(r) for r in runs) if v is not None]
        return _median(vals)
    waste = med(lambda r: 100.0 * (1 - r.slots_used / r.slots_allocated) if r.slots_allocated else None)
    accept = med(lambda r: 100.0 * r.spec_accepted / r.spec_drafted if r.spec_drafted else None)
    ttft, tpot = med(lambda r: _median(r.ttft)), med(lambda r: _median(r.tpot))
    return Row(scenario, model, concurrency, len(runs[0].ttft),
               None if ttft is None else 1000 * ttft, None if tpot is None else 1000 * tpot,
               med(lambda r: r.output_tokens / r.wall), waste, accept, len(runs))


# --- transformers generate ----------------------------------------------------------------------
class _Clock:
    """A generate() streamer that only timestamps: put() is called with the prompt, then once per step."""

    def __init__(self):
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


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
        clock = _Clock()
        t0 = time.perf_counter()
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                           streamer=clock, pad_token_id=pad_id)
        steps = clock.times[1:]  # [0] is the prompt being handed over
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


# --- this engine --------------------------------------------------------------------------------
def _stat(stats: dict, *names: str) -> float:
    for n in names:
        if stats.get(n) is not None:
            return float(stats[n])
    return 0.0


def run_engine(engine, requests: list[Request], concurrency: int, static: bool, sampling_params_cls) -> RunResult:
    """Keep ``concurrency`` requests in flight (continuous), or admit a new batch only when the last one is done."""
    res = RunResult([], [], 0, 0.0)
    before = engine.stats()
    todo = deque(requests)
    inflight: dict[str, dict] = {}
    counter = 0
    start = time.perf_counter()
    while todo or inflight:
        if not static or not inflight:
            while todo and len(inflight) < concurrency:
                r = todo.popleft()
                rid = f"bench-{counter}"
                counter += 1
                params = sampling_params_cls(temperature=0.0, max_tokens=r.output_len, ignore_eos=True)
                engine.add_request(list(r.prompt_ids), params, request_id=rid)
                inflight[rid] = {"arrival": time.perf_counter(), "first": None, "last": None, "n": 0}
        outputs = engine.step()
        now = time.perf_counter()
        s = engine.stats()
        res.slots_allocated += _stat(s, "token_slots_allocated", "slots_allocated")
        res.slots_used += _stat(s, "token_slots_used", "slots_used")
        for out in outputs:
            rec = inflight.get(out.request_id)
            if rec is None:
                continue
            if out.new_token_ids and rec["first"] is None:
                rec["first"] = now
            rec["n"], rec["last"] = out.completion_tokens, now
            if out.finished:
                del inflight[out.request_id]
                res.ttft.append(rec["first"] - rec["arrival"])
                if rec["n"] > 1:
                    res.tpot.append((rec["last"] - rec["first"]) / (rec["n"] - 1))
                res.output_tokens += rec["n"]
    res.wall = time.perf_counter() - start
    after = engine.stats()
    for key, names in (("spec_drafted", ("spec_drafted", "spec_drafted_tokens")),
                       ("spec_accepted", ("spec_accepted", "spec_accepted_tokens"))):
        setattr(res, key, _stat(after, *names) - _stat(before, *names))
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


def run_bench(cfg: BenchConfig, progress=None) -> dict:
    """Run every scenario; returns ``{"config": ..., "rows": [...]}`` (rows as dicts)."""
    say = progress or (lambda msg: log.info(msg))
    base = cfg.baseline or cfg.model
    _check_servable(cfg.model, base)  # minutes of transformers rows are not spent on a model the engine refuses
    top = max(cfg.concurrency)
    rows: list[Row] = []
    rng = random.Random(cfg.seed)
    _, _, SamplingParams = _engine_classes()

    def workload(tokenizer, c: int, grounded: bool = False) -> list[Request]:
        # a fresh offset per run: no two runs share prompts, so prefix caching cannot skip work across rows
        return make_requests(tokenizer, cfg.num_requests(c), cfg.prompt_len, cfg.output_len, cfg.jitter,
                             seed=rng.randrange(1 << 30), grounded=grounded)

    def engine_rows(engine, model: str, label: str, static_too: bool, grounded: bool = False) -> None:
        warm = workload(engine.tokenizer, 1)[:1]
        run_engine(engine, [replace(warm[0], output_len=2)], 1, False, SamplingParams)  # first-call costs out
        for c in cfg.concurrency:
            for static in ((True, False) if static_too else (False,)):
                name = f"{label}-{'static' if static else 'continuous'}"
                say(f"{name} c={c}")
                runs = [run_engine(engine, workload(engine.tokenizer, c, grounded), c, static, SamplingParams)
                        for _ in range(cfg.repeats)]
                rows.append(summarize(name, model, c, runs))

    if cfg.hf:
        from compress.format.models import load_model

        model, tok, _ = load_model(base)
        model = model.float().eval()
        pad = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
        warm = workload(tok, 1)[:1]
        run_hf(model, [replace(warm[0], output_len=2)], 1, pad)
        say("hf-generate batch 1")
        rows.append(summarize("hf-generate-seq", base, 1,
                              [run_hf(model, workload(tok, 1), 1, pad) for _ in range(cfg.repeats)]))
        for c in cfg.concurrency:
            if c > 1:
                say(f"hf-generate static batch {c}")
                rows.append(summarize("hf-generate-static", base, c,
                                      [run_hf(model, workload(tok, c), c, pad) for _ in range(cfg.repeats)]))
        del model
        gc.collect()

    if cfg.baseline and cfg.baseline != cfg.model:
        engine = _build_engine(cfg, base, top, None)
        engine_rows(engine, base, "engine-fp32", static_too=False)
        del engine
        gc.collect()

    engine = _build_engine(cfg, cfg.model, top, None, cfg.dtype, cfg.lm_head, cfg.kv_cache_dtype)
    tag = {"float32": "", "bfloat16": "-bf16", "float16": "-fp16"}[engine.dtype]
    tag += "" if cfg.kv_cache_dtype == "auto" else f"-kv{cfg.kv_cache_dtype}"
    engine_rows(engine, cfg.model, f"engine{tag}", static_too=True)
    if cfg.speculative:
        engine_rows(engine, cfg.model, f"engine{tag}-grounded", static_too=False, grounded=True)
        del engine
        gc.collect()
        engine = _build_engine(cfg, cfg.model, top, "ngram", cfg.dtype, cfg.lm_head, cfg.kv_cache_dtype)
        engine_rows(engine, cfg.model, f"engine{tag}-ngram-spec-grounded", static_too=False, grounded=True)
    stats = engine.stats()
    del engine
    gc.collect()
    return {"config": {**asdict(cfg), "concurrency": list(cfg.concurrency)}, "engine_stats_at_end": stats,
            "rows": [asdict(r) for r in rows]}


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
