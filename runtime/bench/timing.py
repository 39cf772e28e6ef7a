"""The one speed-measurement core: every speed figure (``compress bench``, ``compress report``,
scripts/bench/cpu_speed.py, scripts/bench/gpu_check_engine.py) comes from the timestamps taken here.

A run keeps ``concurrency`` requests in flight on the engine (or admits a new batch only when the last one is
done) and times, per request, TTFT (arrival -> first token) and TPOT (mean gap between later tokens), plus
the run's wall time and when each request's first token came back. A row reports medians: per run over its
requests, then across runs. ``StepClock`` times transformers' ``generate`` the same way, one stamp per step.
"""
from __future__ import annotations

import json
import statistics
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from runtime.bench.workload import Request


def median(xs: list[float]) -> float | None:
    """The median, or None for no values (a row with nothing measured)."""
    return statistics.median(xs) if xs else None


def stream_times(lines: Iterable[bytes], start: float) -> tuple[float | None, float | None, int]:
    """An OpenAI-style server-sent event stream of completions, timed as it is read: (seconds from ``start`` to
    the first chunk with text, seconds from it to the last, completion tokens from the usage chunk); None, None
    where no text came. The served row of ``compress report`` reads a live server through this clock."""
    first = last = None
    tokens = 0
    for line in lines:
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        if chunk.get("usage"):
            tokens = chunk["usage"]["completion_tokens"]
        if any(c.get("text") for c in chunk.get("choices") or ()):
            last = time.perf_counter()
            first = first or last
    return (None, None, tokens) if first is None else (first - start, last - first, tokens)


class StepClock(list):
    """A generate() streamer that only timestamps: put() gets the prompt, then one call per new token."""

    def put(self, value) -> None:
        self.append(time.perf_counter())

    def end(self) -> None:
        pass

    @property
    def steps(self) -> list[float]:
        """One stamp per generated token ([0] was the prompt being handed over)."""
        return self[1:]


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
    first_token_at: list[float] = field(default_factory=list)  # per request, in submission order: s after start


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


def summarize(scenario: str, model: str, concurrency: int, runs: list[RunResult]) -> Row:
    """Per run: medians over requests; across runs: the median of each run-level number."""
    def med(f):
        return median([v for v in (f(r) for r in runs) if v is not None])
    waste = med(lambda r: 100.0 * (1 - r.slots_used / r.slots_allocated) if r.slots_allocated else None)
    accept = med(lambda r: 100.0 * r.spec_accepted / r.spec_drafted if r.spec_drafted else None)
    ttft, tpot = med(lambda r: median(r.ttft)), med(lambda r: median(r.tpot))
    return Row(scenario, model, concurrency, len(runs[0].ttft),
               None if ttft is None else 1000 * ttft, None if tpot is None else 1000 * tpot,
               med(lambda r: r.output_tokens / r.wall), waste, accept, len(runs))


def _stat(stats: dict, *names: str) -> float:
    for n in names:
        if stats.get(n) is not None:
            return float(stats[n])
    return 0.0


def _admit(engine, todo: deque, inflight: dict, concurrency: int, sampling_params_cls) -> None:
    """Submit requests until ``concurrency`` are in flight; greedy, EOS ignored, so lengths are exact."""
    while todo and len(inflight) < concurrency:
        i, r = todo.popleft()
        params = sampling_params_cls(temperature=0.0, max_tokens=r.output_len, ignore_eos=True)
        engine.add_request(list(r.prompt_ids), params, request_id=f"bench-{i}")
        inflight[f"bench-{i}"] = {"i": i, "arrival": time.perf_counter(), "first": None, "last": None, "n": 0}


def run_engine(engine, requests: list[Request], concurrency: int, static: bool, sampling_params_cls,
               kv_slots: bool = True) -> RunResult:
    """Keep ``concurrency`` requests in flight (continuous), or admit a new batch only when the last one is done.

    ``kv_slots`` reads the engine's KV slot counts after every step (the waste figure); off, nothing but the clock
    runs between steps."""
    res = RunResult([], [], 0, 0.0, first_token_at=[0.0] * len(requests))
    before = engine.stats()
    todo, inflight = deque(enumerate(requests)), {}
    start = time.perf_counter()
    while todo or inflight:
        if not static or not inflight:
            _admit(engine, todo, inflight, concurrency, sampling_params_cls)
        outputs = engine.step()
        now = time.perf_counter()
        if kv_slots:
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
                _finish(res, rec, start)
    res.wall = time.perf_counter() - start
    after = engine.stats()
    for key, names in (("spec_drafted", ("spec_drafted", "spec_drafted_tokens")),
                       ("spec_accepted", ("spec_accepted", "spec_accepted_tokens"))):
        setattr(res, key, _stat(after, *names) - _stat(before, *names))
    return res


def _finish(res: RunResult, rec: dict, start: float) -> None:
    res.ttft.append(rec["first"] - rec["arrival"])
    if rec["n"] > 1:
        res.tpot.append((rec["last"] - rec["first"]) / (rec["n"] - 1))
    res.output_tokens += rec["n"]
    res.first_token_at[rec["i"]] = rec["first"] - start
