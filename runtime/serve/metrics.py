"""Serving metrics: TTFT/TPOT histograms, token and request counters, Prometheus text rendering; with a
model name, the same measurements again under vLLM's ``vllm:`` names so its dashboards work unchanged.

Written by hand (the text exposition format is a few lines) so the server needs no extra package.
Format reference: https://prometheus.io/docs/instrumenting/exposition_formats/ (version 0.0.4).
Every metric is thread-safe: the engine thread observes, the event loop renders.
"""
from __future__ import annotations

import bisect
import math
import threading
from dataclasses import dataclass

PREFIX = "compress"
# Seconds; roughly log-spaced from "instant" to "very slow CPU".
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


def _fmt(v: float) -> str:
    """A sample value as Prometheus writes it (+Inf, -Inf, NaN, otherwise Python repr)."""
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v)) if not float(v).is_integer() else str(int(v))


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    esc = {k: str(v).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"') for k, v in labels.items()}
    return "{" + ",".join(f'{k}="{v}"' for k, v in sorted(esc.items())) + "}"


class Histogram:
    """Cumulative-bucket histogram with a running sum and count, like Prometheus' client."""

    def __init__(self, name: str, help: str, buckets: tuple[float, ...]):
        if list(buckets) != sorted(set(buckets)):
            raise ValueError(f"histogram {name}: buckets {buckets} must be strictly increasing")
        self.name, self.help, self.buckets = name, help, tuple(buckets)
        self._counts = [0] * (len(buckets) + 1)  # last slot: above every bound (+Inf only)
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe(self, value: float) -> None:
        with self._lock:
            self._counts[bisect.bisect_left(self.buckets, value)] += 1
            self._sum += value

    @property
    def count(self) -> int:
        with self._lock:
            return sum(self._counts)

    @property
    def sum(self) -> float:
        with self._lock:
            return self._sum

    def render(self, name: str | None = None, labels: dict | None = None) -> list[str]:
        """The histogram's lines, under ``name`` (default its own) with extra constant ``labels``."""
        name, labels = name or self.name, labels or {}
        with self._lock:
            counts, total = list(self._counts), self._sum
        lines = [f"# HELP {name} {self.help}", f"# TYPE {name} histogram"]
        cum = 0
        for bound, c in zip(self.buckets + (math.inf,), counts):
            cum += c
            lines.append(f"{name}_bucket{_labels({**labels, 'le': _fmt(bound)})} {cum}")
        lines += [f"{name}_sum{_labels(labels)} {_fmt(total)}", f"{name}_count{_labels(labels)} {cum}"]
        return lines


class Counter:
    """A monotonically increasing value, optionally split by one set of labels."""

    def __init__(self, name: str, help: str):
        assert name.endswith("_total"), name
        self.name, self.help = name, help
        self._values: dict[tuple, float] = {}
        self._lock = threading.Lock()

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        if amount < 0:
            raise ValueError(f"counter {self.name} cannot decrease (got {amount})")
        key = tuple(sorted(labels.items()))
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + amount

    def value(self, **labels: str) -> float:
        with self._lock:
            return self._values.get(tuple(sorted(labels.items())), 0.0)

    def render(self, name: str | None = None, labels: dict | None = None, rename: dict | None = None) -> list[str]:
        """The counter's lines, under ``name`` with extra ``labels`` and its own label keys ``rename``d."""
        name, labels, rename = name or self.name, labels or {}, rename or {}
        with self._lock:
            items = sorted(self._values.items()) or [((), 0.0)]
        lines = [f"# HELP {name} {self.help}", f"# TYPE {name} counter"]
        return lines + [f"{name}{_labels({**labels, **{rename.get(a, a): b for a, b in k}})} {_fmt(v)}"
                        for k, v in items]


def gauge_lines(name: str, help: str, value: float, labels: dict | None = None, kind: str = "gauge") -> list[str]:
    """A gauge is read fresh at scrape time, so it needs no state: just its lines."""
    return [f"# HELP {name} {help}", f"# TYPE {name} {kind}", f"{name}{_labels(labels or {})} {_fmt(value)}"]


@dataclass(frozen=True)
class RequestTiming:
    """What one finished request contributes: times in seconds since the epoch, token counts."""

    arrival_time: float
    first_token_time: float | None
    finish_time: float
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first (undefined for fewer than two tokens)."""
        if self.first_token_time is None or self.completion_tokens < 2:
            return None
        return (self.finish_time - self.first_token_time) / (self.completion_tokens - 1)


class ServerMetrics:
    """Everything /metrics exposes; the gauges come from ``engine.stats()`` at scrape time."""

    def __init__(self, prefix: str = PREFIX, model_name: str | None = None):
        p = prefix
        self.model_name = model_name  # set: the vLLM-named copies (``vllm:...``) are rendered too
        self.ttft = Histogram(f"{p}_time_to_first_token_seconds", "Time from request arrival to its first output token.", TTFT_BUCKETS)
        self.tpot = Histogram(f"{p}_time_per_output_token_seconds", "Mean time per output token after the first, per request.", TPOT_BUCKETS)
        self.e2e = Histogram(f"{p}_e2e_request_latency_seconds", "Time from request arrival to its last token.", E2E_BUCKETS)
        self.prompt_tokens = Counter(f"{p}_prompt_tokens_total", "Prompt tokens of finished requests.")
        self.generation_tokens = Counter(f"{p}_generation_tokens_total", "Output tokens generated.")
        self.requests = Counter(f"{p}_requests_total", "Finished requests by finish reason.")
        self.rejected = Counter(f"{p}_rejected_requests_total", "Requests refused before reaching the engine, by reason.")
        self.prefix = p

    def record_finished(self, t: RequestTiming) -> None:
        if t.ttft is not None:
            self.ttft.observe(t.ttft)
        if t.tpot is not None:
            self.tpot.observe(t.tpot)
        self.e2e.observe(t.finish_time - t.arrival_time)
        self.prompt_tokens.inc(t.prompt_tokens)
        self.generation_tokens.inc(t.completion_tokens)
        self.requests.inc(finish_reason=t.finish_reason)

    def render(self, stats: dict | None = None) -> str:
        """The Prometheus text exposition of the histograms, counters and the engine's gauges."""
        lines: list[str] = []
        for m in (self.ttft, self.tpot, self.e2e, self.prompt_tokens, self.generation_tokens, self.requests, self.rejected):
            lines += m.render()
        for name, help, value in engine_gauges(stats or {}):
            lines += gauge_lines(f"{self.prefix}_{name}", help, value)
        if self.model_name is not None:
            lines += self._vllm_lines(stats or {})
        return "\n".join(lines) + "\n"

    def _vllm_lines(self, stats: dict) -> list[str]:
        """The same measurements under the names vLLM's Grafana dashboards query, labelled with ``model_name``."""
        labels = {"model_name": self.model_name}
        lines = []
        for metric, name in ((self.ttft, "vllm:time_to_first_token_seconds"),
                             (self.tpot, "vllm:time_per_output_token_seconds"),
                             (self.e2e, "vllm:e2e_request_latency_seconds")):
            lines += metric.render(name, labels)
        lines += self.prompt_tokens.render("vllm:prompt_tokens_total", labels)
        lines += self.generation_tokens.render("vllm:generation_tokens_total", labels)
        lines += self.requests.render("vllm:request_success_total", labels, rename={"finish_reason": "finished_reason"})
        gauges = {g[0]: g for g in engine_gauges(stats)}
        for ours, name in VLLM_GAUGES:
            lines += gauge_lines(name, gauges[ours][1], gauges[ours][2], labels)
        for key, name, help in VLLM_COUNTERS:
            lines += gauge_lines(name, help, _get(stats, key), labels, kind="counter")
        return lines


# vLLM's names for our gauges, and for engine totals it exports as counters (docs: vLLM "Production Metrics")
VLLM_GAUGES = (("num_requests_running", "vllm:num_requests_running"),
               ("num_requests_waiting", "vllm:num_requests_waiting"),
               ("kv_cache_usage_ratio", "vllm:kv_cache_usage_perc"),
               ("kv_cache_usage_ratio", "vllm:gpu_cache_usage_perc"))  # the name dashboards before vLLM v1 read
VLLM_COUNTERS = (("num_preemptions", "vllm:num_preemptions_total", "Sequences preempted (recomputed later)."),
                 ("prefix_cache_queried_tokens", "vllm:prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache."),
                 ("prefix_cache_hit_tokens", "vllm:prefix_cache_hits_total", "Prompt tokens found in the prefix cache."),
                 ("spec_drafted", "vllm:spec_decode_num_draft_tokens_total", "Draft tokens proposed."),
                 ("spec_accepted", "vllm:spec_decode_num_accepted_tokens_total", "Draft tokens accepted."))


def _get(stats: dict, *keys: str, default: float = 0.0) -> float:
    """The first of ``keys`` present in ``stats`` (core's names may vary slightly)."""
    for k in keys:
        if k in stats and stats[k] is not None:
            return float(stats[k])
    return default


def engine_gauges(stats: dict) -> list[tuple[str, str, float]]:
    """(name, help, value) for each gauge derived from ``Engine.stats()``."""
    total = _get(stats, "kv_blocks_total", "num_blocks_total", "blocks_total")
    used = _get(stats, "kv_blocks_used", "num_blocks_used", "blocks_used")
    drafted = _get(stats, "spec_drafted", "spec_drafted_tokens", "num_draft_tokens")
    accepted = _get(stats, "spec_accepted", "spec_accepted_tokens", "num_accepted_tokens")
    slots_alloc = _get(stats, "token_slots_allocated", "slots_allocated")
    slots_used = _get(stats, "token_slots_used", "slots_used")
    return [
        ("num_requests_running", "Requests in the running batch.", _get(stats, "running", "num_running")),
        ("num_requests_waiting", "Requests queued for admission.", _get(stats, "waiting", "num_waiting")),
        ("kv_cache_blocks_total", "KV-cache blocks in the pool.", total),
        ("kv_cache_blocks_used", "KV-cache blocks held by requests or the prefix cache.", used),
        ("kv_cache_usage_ratio", "Fraction of KV-cache blocks in use (0..1).", used / total if total else 0.0),
        ("kv_cache_token_slots_allocated", "Token slots in allocated KV blocks.", slots_alloc),
        ("kv_cache_token_slots_used", "Token slots assigned to a token of a running sequence.", slots_used),
        ("spec_decode_draft_tokens", "Draft tokens proposed so far.", drafted),
        ("spec_decode_accepted_tokens", "Draft tokens accepted so far.", accepted),
        ("spec_decode_acceptance_ratio", "Accepted / drafted tokens (0 when nothing was drafted).", accepted / drafted if drafted else 0.0),
    ]
