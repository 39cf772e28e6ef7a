"""Peak memory of `compress quantize` against model size, and of the runtime's startup on the result.

Each run is its own process (`compress quantize ... --json`), so its peak resident set (VmHWM) is its
own. Models are given as NAME=SPEC (a name such as smollm2-135m, or a folder such as one written by
scripts/make_random_model.py). The runtime check loads each quantized folder in the engine (a tiny KV
pool) and scores three tokens.

    python scripts/bench/stream_memory.py --model smollm2=smollm2-135m --model 8b=out/random-8b \\
        --recipes rtn4 --runtime --json out/stream-memory.json
    python scripts/bench/stream_memory.py --model 8b-4l=out/random-8b-4l --recipes gptq4,awq4 \\
        --nsamples 16 --seqlen 512
    python scripts/bench/stream_memory.py --model smollm2=smollm2-135m --recipes rtn4,gptq4,awq4 --compare-in-memory
"""
from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
COMPRESS = Path(sys.executable).with_name("compress")
STARTUP = """
import sys, torch
from runtime.lm import EngineLM
m = EngineLM(sys.argv[1], max_len=64, batch_size=1)
m(torch.tensor([[1, 2, 3]]))
print(next(int(l.split()[1]) * 1024 for l in open('/proc/self/status') if l.startswith('VmHWM:')))
"""


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f}"


def _disk(spec: str) -> int:
    p = Path(spec)
    if not p.exists():
        from compress.format.models import resolve

        src = resolve(spec)
        p = src.path / src.gguf_file if src.gguf_file else src.path
    return p.stat().st_size if p.is_file() else sum(f.stat().st_size for f in p.glob("*.safetensors"))


def _tensors(folder: Path) -> dict:
    from safetensors.torch import load_file

    from compress.format.shards import shard_files

    out = {}
    for f in shard_files(folder):
        out.update(load_file(str(f)))
    return out


def identical(a: Path, b: Path) -> str:
    """How many of the two checkpoints' tensors are bit for bit equal."""
    import torch

    ta, tb = _tensors(a), _tensors(b)
    same = sum(k in tb and torch.equal(v, tb[k]) for k, v in ta.items())
    return f"{same}/{len(set(ta) | set(tb))}"


def quantize(name: str, spec: str, recipe: str, args, mode: str = "--stream") -> dict:
    out = ROOT / "out" / "mem" / f"{name}-{recipe}{'' if mode == '--stream' else '-in-memory'}"
    report = out.parent / f"{out.name}.json"
    cmd = [str(COMPRESS), "quantize", "--model", spec, "--recipe", recipe, "--out", str(out), "--overwrite",
           "--json", str(report), mode]
    if args.nsamples:
        cmd += ["--nsamples", str(args.nsamples)]
    if args.seqlen:
        cmd += ["--seqlen", str(args.seqlen)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        return {"model": name, "recipe": recipe, "error": proc.stderr.strip().splitlines()[-1]}
    res = json.loads(report.read_text())
    row = {"model": name, "recipe": recipe, "source_bytes": _disk(spec), "params": res["fp_bytes"] // 4,
           "out_bytes": res["out_bytes"], "peak_rss_bytes": res["peak_rss_bytes"], "streamed": res["streamed"],
           "seconds": time.perf_counter() - t0, **res["memory"]}
    if args.compare_in_memory:
        whole = quantize(name, spec, recipe, argparse.Namespace(**{**vars(args), "compare_in_memory": False,
                                                                    "runtime": False}), "--no-stream")
        row["in_memory_peak_rss_bytes"] = whole.get("peak_rss_bytes")
        row["identical_tensors"] = identical(out, ROOT / "out" / "mem" / f"{name}-{recipe}-in-memory")
    if args.runtime:
        proc = subprocess.run([sys.executable, "-c", STARTUP, str(out)], capture_output=True, text=True, cwd=ROOT)
        row["runtime_peak_bytes"] = int(proc.stdout.split()[-1]) if proc.returncode == 0 else None
        if proc.returncode:
            row["runtime_error"] = proc.stderr.strip().splitlines()[-1]
    return row


def _cpu() -> str:
    try:
        return next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.machine()


def table(rows: list[dict]) -> str:
    head = ("| model | params | source GiB | recipe | peak RSS GiB | largest block GiB (fp32) | s/block | output GiB"
            " | runtime startup GiB (x output) | in memory: peak GiB, identical tensors |"
            "\n|---|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | | | {r['recipe']} | error: {r['error']} | | | | | |")
            continue
        rt = r.get("runtime_peak_bytes")
        lines.append(f"| {r['model']} | {r['params'] / 1e9:.2f}B | {_gib(r['source_bytes'])} | {r['recipe']} | "
                     f"{_gib(r['peak_rss_bytes'])} | {_gib(r.get('largest_block_bytes', 0))} | "
                     f"{r.get('seconds_per_block', 0):.1f} | {_gib(r['out_bytes'])} | "
                     + (f"{_gib(rt)} ({rt / r['out_bytes']:.2f}x)" if rt else "") + " | "
                     + (f"{_gib(r['in_memory_peak_rss_bytes'])}, {r['identical_tensors']}"
                        if r.get("identical_tensors") else "") + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", action="append", required=True, help="NAME=SPEC, repeatable")
    ap.add_argument("--recipes", default="rtn4")
    ap.add_argument("--nsamples", type=int, default=None)
    ap.add_argument("--seqlen", type=int, default=None)
    ap.add_argument("--runtime", action="store_true", help="Also measure the runtime's startup on each output.")
    ap.add_argument("--compare-in-memory", action="store_true",
                    help="Also quantize with --no-stream and count the bit-identical tensors.")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    rows = []
    for item in args.model:
        name, _, spec = item.partition("=")
        for recipe in args.recipes.split(","):
            rows.append(quantize(name, spec or name, recipe, args))
            print(json.dumps(rows[-1]), flush=True)
    print(f"\n{_cpu()}; nsamples={args.nsamples} seqlen={args.seqlen}\n")
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
