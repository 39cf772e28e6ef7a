"""scripts/gpu_check.sh's dry run (CPU, TRITON_INTERPRET=1, tiny shapes) and the pure helpers of its Python side.

The dry run takes every code path the GPU run takes: the Triton kernels run under the interpreter against their
torch references, pytest runs two of the kernel tests in a subprocess, the engine serves a 2-block random model
quantized with rtn4. About 25 s on this 2-core machine.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench_scripts import load_bench_script

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def gc():
    return load_bench_script("gpu_check")


@pytest.fixture(scope="module")
def dry_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check")
    env = {**os.environ, "OUT": str(out), "GPU_CHECK_PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--dry-run"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((out / "gpu_check.json").read_text()), out


def test_dry_run_reports_every_section_ok(dry_report, gc):
    report, out = dry_report
    assert report["dry_run"] is True and report["device"] == "cpu"
    assert report["problems"] == [] and gc.check_report(report) == []
    assert {n: s["status"] for n, s in report["sections"].items()} == dict.fromkeys(gc.BUDGETS, "ok")
    assert report["total_s"] < 120  # about 25 s here; the GPU run has its own budgets (gpu_check.BUDGETS)
    assert (out / "gpu_check_pytest.log").is_file()


def test_dry_run_runs_the_kernels_against_their_references(dry_report):
    sections = dry_report[0]["sections"]
    assert sections["environment"]["triton_interpret"] == "1"
    tests = sections["tests"]
    assert (tests["passed"], tests["failed"], tests["errors"]) == (2, 0, 0)
    for name in ("decode_attention", "int4_gemm"):
        sec = sections[name]
        assert sec["cases"] and sec["all_match_reference"] and not sec["skipped_for_time"]
        assert all(c["ok"] for c in sec["cases"])
    assert {c["m"] for c in sections["int4_gemm"]["cases"]} == {1, 8, 32}


def test_dry_run_serves_the_quantized_random_model(dry_report):
    eng = dry_report[0]["sections"]["engine"]
    assert eng["layers"] == 2 and eng["fewer_layers_than_shape"] is False
    assert set(eng["batches"]) == {"1", "4"}
    for row in eng["batches"].values():
        assert row["output_tok_s"] > 0 and row["ttft_ms_p50"] > 0


def test_a_failing_section_keeps_its_error_and_the_run_goes_on(gc):
    def boom(left):
        raise RuntimeError("kernel exploded")

    res = gc.run_section("int4_gemm", boom, total_end=float("inf"))
    assert res["status"] == "error" and res["error"] == "RuntimeError: kernel exploded"
    assert res["budget_s"] == gc.BUDGETS["int4_gemm"] and "traceback" in res
    ok = gc.run_section("environment", lambda left: {"left": left()}, total_end=float("inf"))
    assert ok["status"] == "ok" and 0 < ok["left"] <= gc.BUDGETS["environment"]


def test_check_report_names_what_is_missing(gc):
    report = {"schema": 1, "dry_run": True, "device": "cpu", "total_s": 1.0, "sections": {
        "environment": {"status": "ok"}, "tests": {"status": "error"}, "engine": {"status": "later"}}}
    problems = gc.check_report(report)
    assert "section 'environment' lacks 'bandwidth'" in problems
    assert "section 'tests' failed without an error message" in problems
    assert "section 'engine' has status 'later'" in problems
    assert "section 'int4_gemm' missing" in problems


PLAIN = """tests/runtime/test_a.py::test_x[1] PASSED                                   [ 33%]
tests/runtime/test_a.py::test_x[2] FAILED                                   [ 66%]
tests/runtime/test_b.py::test_y SKIPPED (no CUDA)                           [100%]
=================== 1 failed, 1 passed, 1 skipped in 3.21s ===================
"""
XDIST = """[gw1] [ 50%] PASSED tests/runtime/test_a.py::test_x[1]
[gw0] [100%] ERROR tests/runtime/test_b.py::test_y
"""


def test_parse_pytest_plain_xdist_and_cut_off(gc):
    plain = gc.parse_pytest(PLAIN)
    assert (plain["passed"], plain["failed"], plain["skipped"]) == (1, 1, 1)
    assert plain["failures"] == ["tests/runtime/test_a.py::test_x[2]"]
    assert plain["summary"] == "1 failed, 1 passed, 1 skipped in 3.21s"
    xd = gc.parse_pytest(XDIST)
    assert (xd["passed"], xd["errors"], xd["summary"]) == (1, 1, None)
    cut = gc.parse_pytest(PLAIN.splitlines()[0])  # killed at its timeout: what ran still counts
    assert (cut["passed"], cut["failed"]) == (1, 0)


def test_targets_are_the_kernel_tests_on_the_gpu(gc):
    targets = gc.test_targets(ROOT)
    assert {"tests/runtime/test_triton_attention.py", "tests/runtime/test_triton_qmatmul.py",
            "tests/runtime/test_triton_moe.py"} <= set(targets)
    assert "tests/runtime/test_triton_compile.py" not in targets  # compiles ahead of time, for CPU-only machines


def test_pytest_past_its_budget_is_killed_and_says_so(gc, tmp_path):
    res = gc.run_pytest(["tests/runtime/test_triton_qmatmul.py"], 0.5, tmp_path / "log", workers=1)
    assert res["returncode"] is None and "timed_out_after_s" in res
    assert (tmp_path / "log").is_file()
