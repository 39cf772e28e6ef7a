import math
import random
import re
import threading

import pytest

from runtime.serve.metrics import Counter, Histogram, RequestTiming, ServerMetrics

SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (\S+)$')


def parse(text: str) -> tuple[dict[str, str], dict[tuple[str, str], float]]:
    """Parse Prometheus text format: {name: type}, {(name, labels): value}; fails on malformed lines."""
    types, samples = {}, {}
    assert text.endswith("\n")
    for line in text.strip("\n").split("\n"):
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            assert kind in ("counter", "gauge", "histogram"), line
            types[name] = kind
        elif line.startswith("# HELP "):
            assert len(line.split(" ", 3)) == 4, line
        else:
            m = SAMPLE.match(line)
            assert m, f"malformed sample line: {line!r}"
            samples[(m.group(1), m.group(2) or "")] = float(m.group(3))
    return types, samples


def test_histogram_buckets_are_cumulative_and_match_sum_and_count():
    h = Histogram("x_seconds", "test", (0.1, 0.5, 1.0))
    values = [random.uniform(0, 2) for _ in range(200)] + [0.1, 0.5, 1.0]  # bounds are inclusive (le)
    for v in values:
        h.observe(v)
    types, s = parse("\n".join(h.render()) + "\n")
    assert types == {"x_seconds": "histogram"}
    for bound in (0.1, 0.5, 1.0):
        le = str(int(bound)) if bound == 1.0 else repr(bound)
        assert s[("x_seconds_bucket", f'{{le="{le}"}}')] == sum(v <= bound for v in values)
    assert s[("x_seconds_bucket", '{le="+Inf"}')] == len(values) == s[("x_seconds_count", "")]
    assert s[("x_seconds_sum", "")] == pytest.approx(sum(values))


def test_histogram_rejects_unsorted_buckets():
    with pytest.raises(ValueError, match="strictly increasing"):
        Histogram("x", "test", (1.0, 0.5))


def test_counter_labels_and_no_decrease():
    c = Counter("reqs_total", "test")
    c.inc(finish_reason="stop")
    c.inc(2, finish_reason="length")
    c.inc(finish_reason="stop")
    _, s = parse("\n".join(c.render()) + "\n")
    assert s[("reqs_total", '{finish_reason="stop"}')] == 2
    assert s[("reqs_total", '{finish_reason="length"}')] == 2
    with pytest.raises(ValueError, match="cannot decrease"):
        c.inc(-1)


def test_histogram_is_thread_safe():
    h = Histogram("t", "test", (1.0,))
    threads = [threading.Thread(target=lambda: [h.observe(0.5) for _ in range(2000)]) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert h.count == 8000 and h.sum == pytest.approx(4000)


def test_request_timing_ttft_tpot():
    t = RequestTiming(arrival_time=10.0, first_token_time=10.5, finish_time=12.5, prompt_tokens=7,
                      completion_tokens=5, finish_reason="length")
    assert t.ttft == pytest.approx(0.5) and t.tpot == pytest.approx(0.5)
    one = RequestTiming(10.0, 10.2, 10.2, 3, 1, "stop")
    assert one.tpot is None and one.ttft == pytest.approx(0.2)


def test_server_metrics_render_has_engine_gauges():
    m = ServerMetrics()
    m.record_finished(RequestTiming(0.0, 0.25, 1.25, 11, 5, "stop"))
    m.record_finished(RequestTiming(0.0, 0.75, 0.75, 4, 1, "length"))
    stats = {"running": 3, "waiting": 2, "kv_blocks_total": 100, "kv_blocks_used": 25,
             "spec_drafted": 40, "spec_accepted": 30}
    types, s = parse(m.render(stats))
    assert types["compress_time_to_first_token_seconds"] == "histogram"
    assert s[("compress_time_to_first_token_seconds_count", "")] == 2
    assert s[("compress_time_to_first_token_seconds_sum", "")] == pytest.approx(1.0)
    assert s[("compress_time_per_output_token_seconds_count", "")] == 1  # one-token requests have no TPOT
    assert s[("compress_prompt_tokens_total", "")] == 15
    assert s[("compress_generation_tokens_total", "")] == 6
    assert s[("compress_num_requests_running", "")] == 3
    assert s[("compress_num_requests_waiting", "")] == 2
    assert s[("compress_kv_cache_usage_ratio", "")] == pytest.approx(0.25)
    assert s[("compress_spec_decode_acceptance_ratio", "")] == pytest.approx(0.75)
    assert all(not math.isnan(v) for v in s.values())


def test_server_metrics_render_without_stats_has_zero_gauges():
    types, s = parse(ServerMetrics().render(None))
    assert s[("compress_kv_cache_usage_ratio", "")] == 0
    assert s[("compress_spec_decode_acceptance_ratio", "")] == 0
    assert types["compress_requests_total"] == "counter"
