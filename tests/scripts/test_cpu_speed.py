"""The pure helpers of scripts/bench/cpu_speed.py: llama.cpp output parsing, medians, ratios, the table.

No model, no engine, no llama.cpp run: the sample outputs below were captured from real runs of llama-bench and
llama-batched-bench (llama-cpp-python 0.3.36's llama.cpp, commit 0c1e570) on SmolLM2-135M Q4_1, 2 threads.
"""
import argparse
import ast
import importlib.util
import json
import stat
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench" / "cpu_speed.py"

# llama-bench -p 128 -n 128 -r 1 -o json (fields trimmed: the real entries carry ~45 keys each)
LLAMA_BENCH = json.dumps([
    {"build_commit": "0c1e570", "cpu_info": "AMD EPYC", "model_type": "llama 256M Q4_1", "n_threads": 2,
     "n_prompt": 128, "n_gen": 0, "n_depth": 0, "avg_ns": 573023497, "avg_ts": 223.376529, "stddev_ts": 0.0,
     "samples_ns": [573023497], "samples_ts": [223.377]},
    {"build_commit": "0c1e570", "cpu_info": "AMD EPYC", "model_type": "llama 256M Q4_1", "n_threads": 2,
     "n_prompt": 0, "n_gen": 128, "n_depth": 0, "avg_ns": 1453149602, "avg_ts": 88.08453, "stddev_ts": 0.0,
     "samples_ns": [1453149602], "samples_ts": [88.0845]},
], indent=2)

# llama-batched-bench -c 2304 -b 2048 -ub 512 -npp 128 -ntg 128 -npl 8 --output-format jsonl, stdout and stderr
# together (the warning is real: -c 2304 became 4096), plus the pl=2 line of a real -npp 16 -ntg 8 -npl 1,2 run;
# its stdout ends with a blank line
BATCHED = """0.00.149.538 W llama_context: n_ctx is not divisible by n_seq_max - rounding down to 4096
{"n_kv_max": 4096, "n_batch": 2048, "n_ubatch": 512, "flash_attn": -1, "is_pp_shared": 0, "n_gpu_layers": -1, \
"n_threads": 2, "n_threads_batch": 2, "pp": 128, "tg": 128, "pl": 8, "n_kv": 2048, "t_pp": 7.371032, \
"speed_pp": 138.922195, "t_tg": 7.693688, "speed_tg": 133.096115, "t": 15.064720, "speed": 135.946762}
{"n_kv_max": 512, "n_batch": 2048, "n_ubatch": 512, "flash_attn": -1, "is_pp_shared": 0, "n_gpu_layers": -1, \
"n_threads": 2, "n_threads_batch": 2, "pp": 16, "tg": 8, "pl": 2, "n_kv": 48, "t_pp": 0.498833, \
"speed_pp": 64.149727, "t_tg": 0.444530, "speed_tg": 35.993069, "t": 0.943363, "speed": 50.881790}

"""


@pytest.fixture(scope="module")
def cs():
    spec = importlib.util.spec_from_file_location("cpu_speed", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["cpu_speed"] = mod
    try:
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.modules.pop("cpu_speed", None)


def test_module_level_imports_are_stdlib_only():
    """Importing the script loads nothing heavy (torch, the engine): those come inside main()."""
    tree = ast.parse(SCRIPT.read_text())
    names = {a.name.split(".")[0] for n in tree.body if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module.split(".")[0] for n in tree.body if isinstance(n, ast.ImportFrom)}
    assert names <= set(sys.stdlib_module_names) | {"__future__"}, names


def test_parse_llama_bench(cs):
    got = cs.parse_llama_bench(LLAMA_BENCH)
    assert got == {"pp128": pytest.approx(223.376529), "tg128": pytest.approx(88.08453)}


def test_parse_llama_bench_pg_test_is_kept_apart(cs):
    got = cs.parse_llama_bench(json.dumps([{"n_prompt": 128, "n_gen": 16, "avg_ts": 50.0}]))
    assert got == {"pp128+tg16": 50.0}


def test_parse_batched_bench(cs):
    got = cs.parse_batched_bench(BATCHED)
    assert set(got) == {"par8_out", "par8_decode", "par2_out", "par2_decode"}
    assert got["par8_out"] == pytest.approx(8 * 128 / (7.371032 + 7.693688))  # generated tokens only
    assert got["par8_decode"] == pytest.approx(133.096115)  # S_TG
    assert got["par2_out"] == pytest.approx(2 * 8 / (0.498833 + 0.444530))
    # its own "speed" counts prompt tokens too: pl * (pp + tg) / t
    assert got["par8_out"] == pytest.approx(135.946762 * 128 / 256, rel=1e-4)


@pytest.mark.parametrize("levels, want", [([8], 2048), ([8, 16, 32], 8192), ([1, 3], 768)])
def test_batched_ctx_is_a_multiple_of_256_per_sequence(cs, levels, want):
    ctx = cs.batched_ctx(levels)
    assert ctx == want
    assert ctx >= max(levels) * (cs.PROMPT + cs.GEN) and ctx % (max(levels) * 256) == 0
    assert cs.batched_ctx([4], prompt=300, gen=10) == 4 * 512


@pytest.mark.parametrize("text, want", [("8,16,32", [8, 16, 32]), ("4", [4]), ("8, 16,", [8, 16])])
def test_parse_levels(cs, text, want):
    assert cs.parse_levels(text) == want


@pytest.mark.parametrize("text", ["", "0,8", "a,b", "-1"])
def test_parse_levels_rejects(cs, text):
    with pytest.raises(ValueError, match="--parallel"):
        cs.parse_levels(text)


def test_rows_are_medians_and_ratio_is_engine_over_llamacpp(cs):
    runs = {"engine": {"pp128": [100.0, 300.0, 200.0], "tg128": [30.0, 10.0, 20.0], "par8_out": [80.0],
                       "par8_decode": [90.0]},
            "llamacpp": {"pp128": [50.0, 40.0, 60.0], "tg128": [40.0, 40.0, 40.0], "par8_out": [0.0]},
            "hf": {"pp128": [10.0, 12.0], "tg128": [5.0]}}
    rows = {r.key: r for r in cs.build_rows(runs, [8])}
    assert [r.key for r in cs.build_rows(runs, [8])] == ["pp128", "tg128", "par8_out", "par8_decode"]
    assert (rows["pp128"].engine, rows["pp128"].llamacpp, rows["pp128"].hf) == (200.0, 50.0, 11.0)
    assert rows["pp128"].ratio == pytest.approx(4.0)
    assert rows["tg128"].ratio == pytest.approx(0.5)
    assert rows["par8_out"].ratio is None  # a zero llama.cpp figure gives no ratio, not a division error
    assert rows["par8_decode"].llamacpp is None and rows["par8_decode"].ratio is None
    assert rows["par8_decode"].hf is None


def test_rows_without_other_systems(cs):
    rows = cs.build_rows({"engine": {"pp128": [1.0]}}, [8, 16])
    assert len(rows) == 2 + 2 * 2
    assert all(r.llamacpp is None and r.hf is None and r.ratio is None for r in rows)


def test_format_table(cs):
    rows = [cs.Row("pp128 tok/s", "pp128", 827.04, 321.6, 150.3, 180.3),
            cs.Row("tg128 tok/s", "tg128", 32.8, None, None)]
    lines = cs.format_table(rows).splitlines()
    assert lines[0] == ("| metric | engine | llama.cpp | engine/llama.cpp | transformers fp32 | engine fp32 | "
                        "engine fp32/transformers |")
    assert lines[1].startswith("|---|")
    assert lines[2] == "| pp128 tok/s | 827.0 | 321.6 | 2.57x | 150.3 | 180.3 | 1.20x |"
    assert lines[3] == "| tg128 tok/s | 32.8 | - | - | - | - | - |"
    assert all(line.count("|") == 8 for line in lines)


def test_cpu_model_name(cs):
    text = "processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 9R14\nflags\t\t: fpu\n"
    assert cs.cpu_model_name(text) == "AMD EPYC 9R14"
    assert cs.cpu_model_name("processor\t: 0\n") == "unknown CPU"


def test_metric_keys_cover_every_level(cs):
    keys = [k for k, _ in cs.metric_keys([8, 32])]
    assert keys == ["pp128", "tg128", "par8_out", "par8_decode", "par32_out", "par32_decode"]


def test_metric_keys_with_prompt_lengths(cs):
    keys = [k for k, _ in cs.metric_keys([16], [128, 512])]
    assert keys == ["pp128", "pp512", "tg128", "par16_out", "par16_decode"]


def _fake_tool(folder: Path, name: str, stdout: str) -> None:
    """A stand-in llama.cpp tool that records its arguments and prints ``stdout``."""
    path = folder / name
    path.write_text(f"#!/bin/sh\necho \"$@\" >> {folder}/{name}.args\ncat <<'EOF'\n{stdout}\nEOF\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def test_llamacpp_repeat_runs_every_prompt_length_in_one_call(cs, tmp_path):
    bench = [{"n_prompt": p, "n_gen": 0, "avg_ts": float(p)} for p in (128, 512)]
    bench.append({"n_prompt": 0, "n_gen": 128, "avg_ts": 40.0})
    _fake_tool(tmp_path, "llama-bench", json.dumps(bench))
    got = cs.llamacpp_repeat(tmp_path, tmp_path / "m.gguf", 2, [], [128, 512])
    assert got == {"pp128": 128.0, "pp512": 512.0, "tg128": 40.0}
    args = (tmp_path / "llama-bench.args").read_text().split()
    assert args[args.index("-p") + 1] == "128,512" and args[args.index("-t") + 1] == "2"
    assert not (tmp_path / "llama-batched-bench.args").exists()  # no levels: no batched run


def test_read_bandwidth_is_bytes_over_seconds(cs, monkeypatch):
    bw = cs.read_bandwidth(gib=1 / 64, tries=2)  # a small buffer: only the arithmetic is under test
    assert 1e8 < bw < 1e13
    clock = iter([0.0, 2.0, 10.0, 11.0])  # two tries: 2 s, then 1 s for two loops
    monkeypatch.setattr(cs.time, "perf_counter", lambda: next(clock))
    assert cs.sum_rate(4096, tries=2, loops=2) == pytest.approx(4096 / 0.5)  # the best try, per sum


def test_cpu_speed_prompts_option(cs):
    a = cs.parse_args(["--model", "m", "--prompts", "128,512"])
    assert cs.parse_levels(a.prompts, "--prompts", "128,512") == [128, 512]
    with pytest.raises(ValueError, match="--prompts '0'"):
        cs.parse_levels("0", "--prompts", "128,512")
    assert isinstance(a, argparse.Namespace)
