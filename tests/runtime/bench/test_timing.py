"""The speed-measurement core on a tiny random model: what a run records, not how fast it is."""
import pytest

from live_server import model_dir  # noqa: F401  (a fixture, shared)
from runtime.bench.timing import StepClock, median, run_engine
from runtime.bench.workload import Request


@pytest.fixture(scope="module")
def engine(model_dir):  # noqa: F811
    from runtime.config import EngineConfig
    from runtime.engine import Engine

    return Engine(EngineConfig(model=str(model_dir), max_num_seqs=4, max_model_len=64, kv_cache_memory=4 << 20))


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("kv_slots", [False, True])
def test_a_run_times_every_request_in_submission_order(engine, static, kv_slots):
    from runtime.sequence import SamplingParams

    reqs = [Request(tuple(range(5, 5 + p)), o) for p, o in ((6, 4), (9, 2), (4, 5), (7, 3), (5, 1))]
    res = run_engine(engine, reqs, 2, static, SamplingParams, kv_slots=kv_slots)
    assert res.output_tokens == sum(r.output_len for r in reqs)
    assert len(res.ttft) == len(reqs) and len(res.tpot) == sum(r.output_len > 1 for r in reqs)
    assert all(0 < t <= res.wall for t in res.first_token_at)
    assert (res.slots_allocated > 0) == kv_slots and res.slots_used <= res.slots_allocated
    if static:  # the third request waits for the first batch of two to finish
        assert res.first_token_at[2] > max(res.first_token_at[:2])


def test_median_and_step_clock():
    assert median([]) is None and median([3.0, 1.0, 2.0]) == 2.0 and median([1.0, 2.0]) == 1.5
    clock = StepClock()
    for _ in range(3):
        clock.put(None)
    clock.end()
    assert len(clock.steps) == 2 and clock.steps == clock[1:] and clock.steps[0] <= clock.steps[1]


def test_stream_times_reads_first_and_last_text_chunks_and_the_usage():
    import json
    import time

    from runtime.bench.timing import stream_times

    def sse(obj) -> bytes:
        return b"data: " + json.dumps(obj).encode()
    lines = [b"", sse({"choices": [{"text": ""}]}), sse({"choices": [{"text": "a"}]}), b": keep-alive",
             sse({"choices": [{"text": "b"}]}), sse({"choices": [], "usage": {"completion_tokens": 2}}), b"data: [DONE]"]
    start = time.perf_counter()
    ttft, span, tokens = stream_times(iter(lines), start)
    assert tokens == 2 and 0 <= ttft and 0 <= span and ttft + span <= time.perf_counter() - start
    assert stream_times(iter([b"data: [DONE]"]), start) == (None, None, 0)
