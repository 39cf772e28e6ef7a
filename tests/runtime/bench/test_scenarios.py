"""The benchmark machinery on a tiny random model with tiny lengths (numbers are not checked, shapes are)."""
import json

import pytest
from click.testing import CliRunner

from runtime.bench.scenarios import BenchConfig, format_table
from runtime.bench.timing import RunResult, summarize
from runtime.bench.workload import INSTRUCTION, make_requests
from live_server import char_tokenizer, model_dir  # noqa: F401  (a fixture, shared)


@pytest.mark.parametrize("grounded", [False, True])
def test_requests_have_ragged_lengths_in_range(grounded):
    tok = char_tokenizer()
    reqs = make_requests(tok, 40, 64, 16, jitter=0.5, seed=3, grounded=grounded)
    assert all(32 <= len(r.prompt_ids) <= 64 and 8 <= r.output_len <= 16 for r in reqs)
    assert len({len(r.prompt_ids) for r in reqs}) > 5  # ragged, not constant
    assert make_requests(tok, 40, 64, 16, jitter=0.5, seed=3, grounded=grounded) == reqs
    assert make_requests(tok, 40, 64, 16, jitter=0.5, seed=4, grounded=grounded) != reqs


def test_grounded_prompt_repeats_the_start_of_its_passage():
    tok = char_tokenizer()
    for r in make_requests(tok, 10, 400, 8, jitter=0.0, seed=0, grounded=True):
        text = tok.decode(r.prompt_ids)
        assert text.startswith(INSTRUCTION)
        passage, begun = text[len(INSTRUCTION):].split("\n\nRepeat:\n")
        assert begun and passage.startswith(begun)


def test_summarize_takes_medians_and_waste():
    runs = [RunResult([0.1, 0.3, 0.2], [0.01, 0.03], 30, 2.0, slots_allocated=100, slots_used=75, spec_drafted=10,
                      spec_accepted=4),
            RunResult([0.5, 0.5, 0.5], [0.02, 0.02], 30, 1.0, slots_allocated=100, slots_used=25)]
    row = summarize("x", "m", 2, runs)
    assert row.ttft_ms_p50 == pytest.approx(350)  # median over runs of per-run medians (200, 500)
    assert row.output_tok_s == pytest.approx(22.5)  # (15 + 30) / 2
    assert row.kv_waste_pct == pytest.approx(50)  # (25 + 75) / 2
    assert row.spec_acceptance_pct == pytest.approx(40)  # the run without drafting has no acceptance


def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match="concurrency"):
        BenchConfig(model="m", concurrency=(0,))
    with pytest.raises(ValueError, match="jitter"):
        BenchConfig(model="m", jitter=1.0)


def test_run_bench_tiny_end_to_end(model_dir, tmp_path):  # noqa: F811
    from cli import main

    out = tmp_path / "bench.json"
    args = [str(model_dir), "--prompt-len", "12", "--output-len", "5", "--concurrency", "1,3", "--requests", "3",
            "--json", str(out)]
    res = CliRunner().invoke(main, ["bench", *args])
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    got = {(r["scenario"], r["concurrency"]) for r in data["rows"]}
    assert got == {("hf-generate-seq", 1), ("hf-generate-static", 3),
                   ("engine-static", 1), ("engine-continuous", 1), ("engine-static", 3), ("engine-continuous", 3),
                   ("engine-grounded-continuous", 1), ("engine-grounded-continuous", 3),
                   ("engine-ngram-spec-grounded-continuous", 1), ("engine-ngram-spec-grounded-continuous", 3)}
    for r in data["rows"]:
        assert r["requests"] == 3 and r["output_tok_s"] > 0 and r["ttft_ms_p50"] > 0
        assert r["kv_waste_pct"] is None or 0 <= r["kv_waste_pct"] < 100
    static = next(r for r in data["rows"] if r["scenario"] == "hf-generate-static")
    assert static["kv_waste_pct"] > 0  # ragged lengths padded to the longest
    spec = [r for r in data["rows"] if "spec" in r["scenario"]]
    assert all(r["spec_acceptance_pct"] is not None for r in spec)
    assert "TTFT p50 ms" in res.output and "engine-continuous" in res.output
    assert format_table(data["rows"]).count("\n") == len(data["rows"]) + 1


def test_a_model_nothing_serves_is_refused_before_any_row(tmp_path, monkeypatch):
    import json as _json

    from runtime.bench import scenarios as bench

    import torch
    from safetensors.torch import save_file

    (tmp_path / "config.json").write_text(_json.dumps({"model_type": "not_a_model", "hidden_size": 8}))
    save_file({"w": torch.zeros(2)}, tmp_path / "model.safetensors")
    monkeypatch.setattr(bench, "run_hf", lambda *a, **k: pytest.fail("transformers rows ran first"))
    with pytest.raises(ValueError, match="not_a_model"):
        bench.run_bench(BenchConfig(model=str(tmp_path), prompt_len=8, output_len=2, concurrency=(1,)))
