"""Our engine against llama.cpp on random-weight models of real shapes, side by side in one run (issue 36, item 3):
batch-1 prompts (pp128, pp512), batch-1 decode (tg128) and 16 parallel sequences, plus how much of this machine's
measured read bandwidth each side's batch-1 decode uses.

  .venv/bin/python scripts/bench/shapes.py --shape 0.5b,1b --repeats 3 [--work out/shapes] [--layers N]
      [--threads T] [--parallel 16] [--prompts 128,512] [--llamacpp-bin DIR] [--json PATH] [--prepare-only]

Per shape, every artifact is made once under --work and reused when present (--layers N: the shape's first N
layers, for quick runs; names end in -Nl):
  random-S/            scripts/make_random_model.py --shape S (bf16 random weights, the embedded SmolLM2 tokenizer)
  random-S-rtn4/       compress quantize --recipe rtn4 --stream: what the engine runs
  random-S-f16.gguf    compress export --format gguf --dtype float16 of the fp model: llama-quantize's input
  random-S-q4_k_m.gguf llama-quantize ... Q4_K_M: llama.cpp's own 4-bit file of the same fp model
  random-S-rtn4.gguf   compress export --format gguf of the rtn4 checkpoint: the engine's integers, losslessly (group
                       64 asymmetric -> Q4_1, each 32-wide block repeating its group's scale and min; the tied int8
                       table -> Q8_0)
Then the read bandwidth is measured once (cpu_speed.read_bandwidth; beside it the same sum over 1 MiB, in cache:
if that is not well above it, the sum is compute-bound and the bandwidth shares are upper bounds), and per shape
the engine, llama.cpp on the Q4_K_M and llama.cpp on our GGUF run in turn for --repeats interleaved repeats
(scripts/bench/cpu_speed.py's machinery); rows are medians. Bytes a decode token reads: the engine's are traced from
one batch-1 decode step (runtime/bench/reads.py: the weights as its kernels hold them); llama.cpp's are the GGUF's
tensors, of which the token embedding is read one row a token unless it is also the (tied) output head. The KV cache
is left out on both sides (under 1% here: a few hundred bytes a layer per context token). Bandwidth used = bytes a
token x tg128 tok/s; its share is against the measured read bandwidth. Prints one markdown table per shape, and
writes all figures, per-repeat numbers and stage times as JSON (--json, default WORK/shapes.json).
"""
from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import random
import shlex
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[2]
# column key -> header; "engine" is what the ratios divide
SIDES = {"engine": "engine rtn4", "q4km": "llama.cpp Q4_K_M", "ours": "llama.cpp rtn4 GGUF (Q4_1)"}
GB = 1e9


# --- pure helpers (unit-tested in tests/scripts/test_shapes.py) -------------------------------------------------
@dataclass(frozen=True)
class Artifacts:
    """Where one shape's files live under --work."""

    fp: Path
    rtn4: Path
    f16: Path
    q4km: Path
    ours: Path


def artifact_paths(work: Path, shape: str, layers: int | None) -> Artifacts:
    stem = f"random-{shape}" + (f"-{layers}l" if layers else "")
    return Artifacts(work / stem, work / f"{stem}-rtn4", work / f"{stem}-f16.gguf", work / f"{stem}-q4_k_m.gguf",
                     work / f"{stem}-rtn4.gguf")


def parse_shapes(values: list[str], known: Iterable[str]) -> list[str]:
    """--shape 0.5b,1b (or repeated) -> ['0.5b', '1b'], in order, once each; an unknown name is an error."""
    known = list(known)
    shapes = list(dict.fromkeys(s.strip() for v in values for s in v.split(",") if s.strip()))
    bad = [s for s in shapes if s not in known]
    if bad or not shapes:
        raise ValueError(f"--shape {','.join(values)!r}: {', '.join(bad) or 'none given'}; choose from "
                         f"{', '.join(known)} (comma-separated, e.g. 0.5b,1b)")
    return shapes


def gguf_token_bytes(tensors: Iterable[tuple[str, int, int]]) -> int:
    """Bytes llama.cpp reads per decode token from (name, bytes, rows) of a GGUF's tensors: all of them, except a
    token embedding with a separate ``output`` head, of which one row is read."""
    tensors = list(tensors)
    untied = any(name == "output.weight" for name, _, _ in tensors)
    return sum(b // rows if untied and name == "token_embd.weight" else b for name, b, rows in tensors)


def bandwidth_used(bytes_per_token: int | None, tok_s: float | None) -> float | None:
    """Bytes/s a decode of ``tok_s`` tokens/s streams when each token reads ``bytes_per_token``."""
    return None if bytes_per_token is None or tok_s is None else bytes_per_token * tok_s


def share(used: float | None, bandwidth: float | None) -> float | None:
    """``used`` as a fraction of the measured ``bandwidth`` (None where either is missing)."""
    return None if used is None or not bandwidth else used / bandwidth


@dataclass(frozen=True)
class SpeedRow:
    """One metric's medians per side (SIDES' keys; None: not measured)."""

    label: str
    key: str
    values: dict[str, float | None]

    def ratio(self, side: str) -> float | None:
        """engine / ``side`` (above 1: the engine is faster)."""
        e, o = self.values.get("engine"), self.values.get(side)
        return None if e is None or not o else e / o


def speed_rows(runs: dict[str, dict[str, list[float]]], keys: list[tuple[str, str]]) -> list[SpeedRow]:
    """runs[side][key]: one number per repeat -> a row of medians per (key, label)."""
    import statistics

    def med(side: str, key: str) -> float | None:
        xs = runs.get(side, {}).get(key, [])
        return statistics.median(xs) if xs else None
    return [SpeedRow(label, key, {s: med(s, key) for s in SIDES}) for key, label in keys]


def _cell(x: float | None, fmt: str = "{:.1f}") -> str:
    return "-" if x is None else fmt.format(x)


def format_speed(rows: list[SpeedRow]) -> str:
    """Markdown: each side's tok/s, and engine / each llama.cpp side."""
    others = [s for s in SIDES if s != "engine"]
    head = ["metric", SIDES["engine"]]
    head += [h for s in others for h in (SIDES[s], f"engine / {SIDES[s].split(' ', 1)[1]}")]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for r in rows:
        cells = [r.label, _cell(r.values.get("engine"))]
        cells += [c for s in others for c in (_cell(r.values.get(s)), _cell(r.ratio(s), "{:.2f}x"))]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_reads(token_bytes: dict[str, int | None], decode: dict[str, float | None], bandwidth: float | None) -> str:
    """Markdown: per side, MiB a decode token reads, tg tok/s, GB/s that makes, and its share of ``bandwidth``."""
    bw = "-" if not bandwidth else f"{bandwidth / GB:.1f}"
    lines = [f"| batch-1 decode | MiB a token reads | tok/s | GB/s read | of measured {bw} GB/s |",
             "|---|---:|---:|---:|---:|"]
    for side, header in SIDES.items():
        b, tok = token_bytes.get(side), decode.get(side)
        used = bandwidth_used(b, tok)
        lines.append(f"| {header} | {_cell(b and b / 2**20)} | {_cell(tok)} | {_cell(used and used / GB, '{:.2f}')} | "
                     f"{_cell(share(used, bandwidth), '{:.0%}')} |")
    return "\n".join(lines)


def cpu_label(cpuinfo: str, name: str) -> str:
    """``name`` with the first CPU's family, model and stepping from /proc/cpuinfo's text: a VM may show only
    'AMD EPYC', and these numbers still tell the generation (family 25 model 17: Zen 4)."""
    ids = {}
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("cpu family", "model", "stepping") and key.strip() not in ids:
            ids[key.strip()] = value.strip()
    return f"{name} ({', '.join(f'{k} {v}' for k, v in ids.items())})" if ids else name


def describe(config: dict) -> str:
    """'hidden 896, 24 layers, 14/2 heads, MLP 4864, vocab 151936, tied' from a config.json."""
    tied = "tied" if config.get("tie_word_embeddings") else "untied"
    return (f"hidden {config['hidden_size']}, {config['num_hidden_layers']} layers, {config['num_attention_heads']}/"
            f"{config['num_key_value_heads']} heads, MLP {config['intermediate_size']}, vocab {config['vocab_size']}, "
            f"{tied}")


# --- artifacts -----------------------------------------------------------------------------------------------
def run(cmd: list, **kw) -> None:
    cmd = [str(c) for c in cmd]
    log.info("+ %s", shlex.join(cmd))
    subprocess.run(cmd, check=True, stdout=sys.stderr, cwd=ROOT, **kw)


def make_artifacts(art: Artifacts, shape: str, layers: int | None, bin_dir: Path, threads: int) -> dict[str, float]:
    """Each missing artifact made in turn (see the module docstring); returns seconds per stage that ran."""
    py = sys.executable
    stages = [
        (art.fp, [py, "scripts/make_random_model.py", "--shape", shape, "--out", art.fp]
         + (["--layers", layers] if layers else [])),
        (art.rtn4, [py, "-m", "cli", "quantize", "--recipe", "rtn4", "--model", art.fp, "--stream", "--out", art.rtn4]),
        (art.f16, [py, "-m", "cli", "export", art.fp, "--format", "gguf", "--dtype", "float16", "--out", art.f16]),
        (art.q4km, [bin_dir / "llama-quantize", art.f16, f"{art.q4km}.tmp", "Q4_K_M", threads]),
        (art.ours, [py, "-m", "cli", "export", art.rtn4, "--format", "gguf", "--out", art.ours]),
    ]
    times = {}
    for out, cmd in stages:
        if out.exists():
            log.info("have %s", out)
            continue
        t0 = time.perf_counter()
        run(cmd)
        if out == art.q4km:  # llama-quantize writes in place: only a finished file gets the final name
            Path(f"{art.q4km}.tmp").rename(art.q4km)
        times[out.name] = time.perf_counter() - t0
        log.info("made %s in %.1f s", out, times[out.name])
    return times


def gguf_tensors(path: Path) -> list[tuple[str, int, int]]:
    """(name, bytes, rows) of every tensor in a GGUF file."""
    import gguf

    return [(t.name, int(t.n_bytes), int(t.n_elements) // int(t.shape[0])) for t in gguf.GGUFReader(str(path)).tensors]


# --- the run -------------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", action="append", required=True, help="shapes of make_random_model.py, e.g. 0.5b,1b")
    ap.add_argument("--layers", type=int, help="only the first N layers (quick runs); default: the shape's depth")
    ap.add_argument("--work", default="out/shapes", help="artifact folder (made once, reused)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--parallel", default="16", help="concurrent sequences per level, e.g. 16 or 8,16")
    ap.add_argument("--prompts", default="128,512", help="prompt lengths of the batch-1 prompt rows")
    ap.add_argument("--threads", type=int, help="torch and llama.cpp threads; default: torch.get_num_threads()")
    ap.add_argument("--llamacpp-bin", help="folder with llama-bench etc.; default: built by scripts/bench/llamacpp.sh")
    ap.add_argument("--bandwidth-gib", type=float, default=1.0, help="buffer of the read-bandwidth measurement")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="default: WORK/shapes.json")
    ap.add_argument("--prepare-only", action="store_true",
                    help="make the missing artifacts and stop (on a busy machine; measure later on a quiet one)")
    return ap.parse_args(argv)


@dataclass(frozen=True)
class Options:
    """The validated command line."""

    shapes: list[str]
    layers: int | None
    work: Path
    repeats: int
    levels: list[int]
    prompts: list[int]
    threads: int | None
    bandwidth_gib: float


def validate(a: argparse.Namespace, known: Iterable[str], parse_levels) -> Options:
    """The options, or ValueError naming the bad one; --work made absolute (the stages run from the repository root)."""
    if a.repeats < 1:
        raise ValueError(f"--repeats {a.repeats} must be >= 1")
    if a.layers is not None and a.layers < 1:
        raise ValueError(f"--layers {a.layers} must be >= 1 (leave it out for the shape's full depth)")
    if a.threads is not None and a.threads < 1:
        raise ValueError(f"--threads {a.threads} must be >= 1")
    if not a.bandwidth_gib >= 0.25:
        raise ValueError(f"--bandwidth-gib {a.bandwidth_gib} must be >= 0.25: a smaller buffer measures caches")
    return Options(parse_shapes(a.shape, known), a.layers, Path(a.work).resolve(), a.repeats, parse_levels(a.parallel),
                   parse_levels(a.prompts, "--prompts", "128,512"), a.threads, a.bandwidth_gib)


def measure_shape(cs, o: Options, art: Artifacts, bin_dir: Path, threads: int, rng: random.Random) -> dict:
    """Engine, llama.cpp on Q4_K_M and llama.cpp on our GGUF, interleaved; the shape's rows, reads and raw runs."""
    from runtime.bench.reads import decode_step_reads
    from runtime.sequence import SamplingParams

    engine = cs.build_engine(str(art.rtn4), "auto", max(o.levels))
    cs.drive(engine, SamplingParams, cs.random_prompts(rng, 1, max(o.prompts)), 4)  # first-call costs out
    cs.drive(engine, SamplingParams, cs.random_prompts(rng, min(o.levels), 16), 4)
    reads = decode_step_reads(engine, SamplingParams, cs.random_prompts(rng, 1, cs.TINY_PROMPT)[0])
    todo = {"engine": lambda: cs.engine_repeat(engine, SamplingParams, rng, o.levels, o.prompts),
            "q4km": lambda: cs.llamacpp_repeat(bin_dir, art.q4km, threads, o.levels, o.prompts),
            "ours": lambda: cs.llamacpp_repeat(bin_dir, art.ours, threads, o.levels, o.prompts)}
    load_before = os.getloadavg()[0]
    runs = {s: r for s, r in cs.interleave(todo, o.repeats).items() if s in SIDES}
    engine_info = {"dtype": engine.dtype, "lm_head": engine.runner.lm_head_kind, "cpu_ops": engine.runner.ops.name,
                   "kernel_paths": engine.runner.kernel_paths, "decode_reads": asdict(reads)}
    token_bytes = {"engine": reads.total, "q4km": gguf_token_bytes(gguf_tensors(art.q4km)),
                   "ours": gguf_token_bytes(gguf_tensors(art.ours))}
    return {"rows": speed_rows(runs, cs.metric_keys(o.levels, o.prompts)), "token_bytes": token_bytes, "runs": runs,
            "engine": engine_info, "loadavg_1min": [load_before, os.getloadavg()[0]]}


def report_shape(shape: str, config: dict, res: dict, bandwidth: float, gen: int) -> None:
    rows = res["rows"]
    decode = next(r for r in rows if r.key == f"tg{gen}").values
    load = res["loadavg_1min"]
    print(f"\n### {shape} ({describe(config)}); load avg {load[0]:.1f} -> {load[1]:.1f}\n")
    print(format_speed(rows))
    print()
    print(format_reads(res["token_bytes"], decode, bandwidth))


def shape_json(res: dict, config: dict, art: Artifacts, bandwidth: float, gen: int) -> dict:
    """One shape's results for the JSON file: rows as dicts with their ratios, and each side's decode bandwidth."""
    rows = [{"key": r.key, "label": r.label, **r.values, **{f"engine/{k}": r.ratio(k) for k in SIDES if k != "engine"}}
            for r in res["rows"]]
    decode = next(r for r in res["rows"] if r.key == f"tg{gen}").values
    used = {s: bandwidth_used(b, decode.get(s)) for s, b in res["token_bytes"].items()}
    return {**res, "rows": rows, "config": describe(config), "artifacts": {k: str(v) for k, v in asdict(art).items()},
            "decode_gbs": {s: u and u / GB for s, u in used.items()},
            "bandwidth_share": {s: share(u, bandwidth) for s, u in used.items()}}


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    sys.path.insert(0, str(ROOT))  # run as a file from anywhere
    sys.path.insert(0, str(ROOT / "scripts"))
    sys.path.insert(0, str(ROOT / "scripts" / "bench"))
    import cpu_speed as cs
    import make_random_model

    try:
        o = validate(a, make_random_model.SHAPES, cs.parse_levels)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    import torch

    if o.threads:
        torch.set_num_threads(o.threads)
    threads = torch.get_num_threads()
    bin_dir = cs.llamacpp_bin_dir(a.llamacpp_bin)
    o.work.mkdir(parents=True, exist_ok=True)
    arts = {s: artifact_paths(o.work, s, o.layers) for s in o.shapes}
    stage_times = {s: make_artifacts(arts[s], s, o.layers, bin_dir, threads) for s in o.shapes}
    if a.prepare_only:
        print(json.dumps({s: {"artifacts": {k: str(v) for k, v in asdict(arts[s]).items()}, "seconds": stage_times[s]}
                          for s in o.shapes}, indent=2))
        return
    bandwidth = cs.read_bandwidth(o.bandwidth_gib)
    in_cache = cs.sum_rate(1 << 20, loops=1000)  # the same sum from L2: far above `bandwidth` if that is memory-bound
    cpuinfo = Path("/proc/cpuinfo").read_text()
    meta = {"cpu": cpu_label(cpuinfo, cs.cpu_model_name(cpuinfo)), "threads": threads,
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "read_bandwidth_gbs": bandwidth / GB,
            "sum_in_cache_gbs": in_cache / GB,
            "command": shlex.join([sys.executable, *sys.argv]), "repeats": o.repeats, "parallel": o.levels,
            "prompts": o.prompts, "layers": o.layers, "torch": torch.__version__, "llamacpp_bin": str(bin_dir),
            "stage_seconds": stage_times}
    print(f"CPU: {meta['cpu']} | threads: {threads} | date: {meta['date']} | read bandwidth {bandwidth / GB:.1f} GB/s "
          f"(best of 5 sums over {o.bandwidth_gib:g} GiB; the same sum in cache: {in_cache / GB:.1f} GB/s) | "
          f"medians of {o.repeats} repeat(s)")
    print(f"command: {meta['command']}")
    made = [f"{name} {sec:.0f} s" for times in stage_times.values() for name, sec in times.items()]
    print(f"made this run: {', '.join(made) or 'nothing (all artifacts cached)'}")
    out = {"meta": meta, "shapes": {}}
    rng = random.Random(a.seed)
    for s in o.shapes:
        config = json.loads((arts[s].fp / "config.json").read_text())
        res = measure_shape(cs, o, arts[s], bin_dir, threads, rng)
        report_shape(s, config, res, bandwidth, cs.GEN)
        out["shapes"][s] = shape_json(res, config, arts[s], bandwidth, cs.GEN)
        gc.collect()  # the shape's engine, before the next one is built
    path = Path(a.json or o.work / "shapes.json")
    path.write_text(json.dumps(out, indent=2, default=str))
    log.info("wrote %s", path)


if __name__ == "__main__":
    main()
