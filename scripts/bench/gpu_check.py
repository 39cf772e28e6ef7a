"""A ready GPU check (issue 36): the Triton kernels' tests on the GPU, then kernel and engine timings, in one JSON.

    bash scripts/gpu_check.sh                    # on a CUDA machine: writes $OUT/gpu_check.json (under 8 minutes)
    python scripts/bench/gpu_check.py --dry-run --out /tmp/gpu_check.json   # CPU, TRITON_INTERPRET=1, tiny shapes

Sections, each with its own time budget and its own try/except (one failure keeps the rest), the JSON rewritten
after each: environment (versions, GPU, copy bandwidth), tests (the Triton kernel tests and any test marked
``cuda``, in a pytest subprocess), decode_attention (paged flash-decoding against the torch path, as a fraction of
the measured bandwidth), int4_gemm (Triton int4 against a dense matmul at 1, 8 and 32 rows), engine (a random
1b-shape Llama, rtn4, at batch 1 and 64). The dry run takes the same paths on CPU with the kernels interpreted.
docs/gpu.md says what each number means.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = 1
# seconds per section on a GPU (the dry run's are the same, and far from reached); 420 s together, under 8 minutes
BUDGETS = {"environment": 20, "tests": 150, "decode_attention": 45, "int4_gemm": 45, "engine": 160}
REQUIRED = {  # keys an "ok" section must carry (check_report)
    "environment": ("python", "torch", "triton", "cuda", "device_name", "bandwidth", "missing_packages"),
    "tests": ("files", "passed", "failed", "errors", "skipped", "returncode"),
    "decode_attention": ("cases", "bandwidth_gb_s", "all_match_reference"),
    "int4_gemm": ("cases", "bandwidth_gb_s", "all_match_reference"),
    "engine": ("shape", "layers", "batches", "quantize_s", "checkpoint"),
}
PACKAGES = ("torch", "triton", "transformers", "tokenizers", "safetensors", "yaml", "pytest", "hypothesis")
DRY_TESTS = ["tests/runtime/test_triton_qmatmul.py::test_fp16_activations",
             "tests/runtime/test_triton_attention.py::test_decode_equals_prefill_of_one_token"]


class Deadline:
    """Seconds left for a section: its own budget and the whole run's, whichever ends first."""

    def __init__(self, budget_s: float, total_end: float):
        self.end = min(time.monotonic() + budget_s, total_end)

    def left(self) -> float:
        return self.end - time.monotonic()


def run_section(name: str, fn: Callable[[Callable[[], float]], dict], total_end: float) -> dict:
    """``fn(left)`` timed under its budget; an exception becomes ``status: error`` with its message."""
    budget = BUDGETS[name]
    deadline = Deadline(budget, total_end)
    print(f"[gpu_check] {name}: start (budget {budget} s)", flush=True)
    t0 = time.monotonic()
    try:
        res = {"status": "ok", **fn(deadline.left)}
    except Exception as e:  # one section's failure must not lose the others
        res = {"status": "error", "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
    res.update(seconds=round(time.monotonic() - t0, 1), budget_s=budget)
    res["over_budget"] = res["seconds"] > budget
    print(f"[gpu_check] {name}: {res['status']} in {res['seconds']} s"
          + (f" ({res['error']})" if res["status"] == "error" else ""), flush=True)
    return res


def check_report(report: dict) -> list[str]:
    """What is wrong with a report's shape (empty: nothing)."""
    problems = [f"missing top-level {k!r}" for k in ("schema", "dry_run", "device", "sections", "total_s")
                if k not in report]
    for name, keys in REQUIRED.items():
        sec = report.get("sections", {}).get(name)
        if sec is None:
            problems.append(f"section {name!r} missing")
            continue
        if sec.get("status") not in ("ok", "error", "skipped"):
            problems.append(f"section {name!r} has status {sec.get('status')!r}")
        if sec.get("status") == "ok":
            problems += [f"section {name!r} lacks {k!r}" for k in keys if k not in sec]
        if sec.get("status") == "error" and not sec.get("error"):
            problems.append(f"section {name!r} failed without an error message")
    return problems


def write_json(path: Path, report: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(report, indent=2, default=str))
    tmp.replace(path)


def versions() -> dict:
    """Python, torch, CUDA and Triton versions, and which packages the check uses are missing."""
    import torch

    def version(name: str) -> str | None:
        if importlib.util.find_spec(name) is None:
            return None
        return getattr(__import__(name), "__version__", "?")

    return {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "cuda_available": torch.cuda.is_available(), "triton": version("triton"),
            "transformers": version("transformers"), "cpu_count": os.cpu_count(),
            "triton_interpret": os.environ.get("TRITON_INTERPRET"),
            "missing_packages": [p for p in PACKAGES if importlib.util.find_spec(p) is None]}


def device_info(device) -> dict:
    import torch

    if device.type != "cuda":
        return {"device_name": f"cpu ({platform.processor() or platform.machine()})"}
    props = torch.cuda.get_device_properties(device)
    free, total = torch.cuda.mem_get_info(device)
    return {"device_name": props.name, "capability": f"{props.major}.{props.minor}",
            "multiprocessors": props.multi_processor_count, "memory_gib": round(total / 2**30, 1),
            "free_gib": round(free / 2**30, 1), "driver_cuda": torch.version.cuda}


def test_targets(root: Path) -> list[str]:
    """The Triton kernel tests (each kernel against its torch reference) and every file with a ``cuda`` mark."""
    tests = root / "tests"
    triton = {p for p in tests.rglob("test_triton_*.py") if p.name != "test_triton_compile.py"}  # AOT: CPU only
    marked = {p for p in tests.rglob("test_*.py") if re.search(r"mark\.cuda\b", p.read_text())}
    return [str(p.relative_to(root)) for p in sorted(triton | marked)]


NODE = re.compile(r"(\S+::\S+)")
STATUS = re.compile(r"\b(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")


def parse_pytest(text: str) -> dict:
    """Per-test outcomes from ``pytest -v -rN`` output (plain or xdist), also from a run cut off by its timeout."""
    outcome: dict[str, str] = {}
    for line in text.splitlines():
        node, status = NODE.search(line), STATUS.search(line)
        if node and status:
            outcome[node.group(1)] = status.group(1)
    count = {s: sum(v == s for v in outcome.values()) for s in ("PASSED", "FAILED", "ERROR", "SKIPPED")}
    summary = [ln.strip("= ") for ln in text.splitlines() if re.match(r"=+ .* in [\d.]+s", ln)]
    return {"passed": count["PASSED"], "failed": count["FAILED"], "errors": count["ERROR"],
            "skipped": count["SKIPPED"], "failures": sorted(n for n, s in outcome.items() if s in ("FAILED", "ERROR")),
            "summary": summary[-1] if summary else None}


def run_pytest(targets: list[str], timeout: float, log: Path, workers: int) -> dict:
    """pytest in its own process group (killed whole at ``timeout``), output in ``log``."""
    cmd = [sys.executable, "-m", "pytest", *targets, "-v", "-rN", "-p", "no:cacheprovider", "-m", "not slow"]
    if importlib.util.find_spec("pytest_timeout"):
        cmd.append("--timeout=300")
    if workers > 1 and importlib.util.find_spec("xdist"):
        cmd += ["-n", str(workers)]
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=max(timeout, 1))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
            rc = None
    res = parse_pytest(log.read_text(errors="replace"))
    if rc is None:
        res["timed_out_after_s"] = round(max(timeout, 1), 1)
    elif rc not in (0, 1) or not any(res[k] for k in ("passed", "failed", "errors", "skipped")):
        res["output_tail"] = log.read_text(errors="replace")[-3000:]
    return {"command": " ".join(cmd[1:]), "returncode": rc, "log": log.name, **res}


def sections(args, device, out_dir: Path, work: Path) -> dict[str, Callable]:
    """Each section as ``fn(left) -> dict``; the kernel sections reuse the bandwidth the environment measured."""
    import dataclasses

    import gpu_check_engine as eng
    import gpu_check_kernels as kern

    dry = device.type != "cuda"
    plan = kern.DRY_PLAN if dry else kern.GPU_PLAN
    eplan = eng.DRY_ENGINE if dry else eng.GPU_ENGINE
    if args.layers:
        eplan = dataclasses.replace(eplan, layers=args.layers)
    state: dict = {}

    def bandwidth() -> float:
        if "bw" not in state:
            state["bw"] = kern.bandwidth(device, plan)
        return state["bw"]["gb_s"]

    def environment(left):
        info = versions()
        print(f"[gpu_check] torch {info['torch']}, triton {info['triton']}, CUDA {info['cuda']}; missing packages: "
              f"{', '.join(info['missing_packages']) or 'none'}", flush=True)
        bandwidth()
        return {**info, **device_info(device), "bandwidth": state["bw"]}

    def tests(left):
        targets = DRY_TESTS if dry else test_targets(ROOT)
        return {"files": targets, **run_pytest(targets, left(), out_dir / "gpu_check_pytest.log", 1 if dry else 8)}

    return {"environment": environment, "tests": tests,
            "decode_attention": lambda left: kern.decode_attention_section(plan, device, bandwidth(), left),
            "int4_gemm": lambda left: kern.gemm_section(plan, device, bandwidth(), left),
            "engine": lambda left: eng.engine_section(eplan, ROOT, work, device.type, left)}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None,
                    help="The JSON to write [default: $OUT/gpu_check.json, else ./gpu_check.json].")
    ap.add_argument("--dry-run", action="store_true", default=os.environ.get("GPU_CHECK_DRY_RUN") == "1",
                    help="CPU, TRITON_INTERPRET=1, tiny shapes: the same code paths, in seconds (CI runs it).")
    ap.add_argument("--layers", type=int, default=None,
                    help="Engine: this many decoder blocks instead of the shape's (the JSON says so).")
    ap.add_argument("--only", default=None, help=f"Comma-separated sections to run, of {','.join(BUDGETS)}.")
    ap.add_argument("--work", type=Path, default=None, help="Where the random model is written [default: a temp dir].")
    args = ap.parse_args(argv)
    if args.out is None:
        args.out = Path(os.environ.get("OUT") or ".") / "gpu_check.json"
    if args.only and set(args.only.split(",")) - set(BUDGETS):
        ap.error(f"--only {args.only!r}: unknown section(s); use {','.join(BUDGETS)}")
    if args.layers is not None and args.layers < 1:
        ap.error(f"--layers {args.layers} must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # Triton picks interpreter or compiler once, at its first import: settle it before anything loads Triton
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"
    else:  # a GPU run times compiled kernels, whatever the caller's environment says
        os.environ.pop("TRITON_INTERPRET", None)
    sys.path[:0] = [str(ROOT), str(Path(__file__).resolve().parent)]
    import torch

    cuda = torch.cuda.is_available() and not args.dry_run
    device = torch.device("cuda" if cuda else "cpu")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    total_end = start + sum(BUDGETS.values()) + 30
    report = {"schema": SCHEMA, "dry_run": args.dry_run, "device": device.type, "layers_override": args.layers,
              "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "sections": {}, "total_s": None}
    with tempfile.TemporaryDirectory(prefix="gpu_check_", dir=args.work) as work:
        for name, fn in sections(args, device, args.out.parent, Path(work)).items():
            if args.only and name not in args.only.split(","):
                continue
            if not cuda and not args.dry_run and name != "environment":
                report["sections"][name] = {"status": "skipped", "reason": "no CUDA device; --dry-run is the CPU form"}
                continue
            report["sections"][name] = run_section(name, fn, total_end)
            report["total_s"] = round(time.monotonic() - start, 1)
            write_json(args.out, report)
    report["total_s"] = round(time.monotonic() - start, 1)
    report["problems"] = [] if args.only else check_report(report)
    write_json(args.out, report)
    failed = [n for n, s in report["sections"].items() if s["status"] == "error"]
    print(f"[gpu_check] wrote {args.out} in {report['total_s']} s; errors: {failed or 'none'}", flush=True)
    return 1 if failed or report["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
