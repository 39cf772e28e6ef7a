"""CPU speed of our engine next to llama.cpp and transformers, in one run on one machine with one thread count:
prompt processing (pp128; --prompts 128,512 for more lengths), batch-1 decode (tg128), and N parallel sequences of
128 prompt + 128 output tokens; --bandwidth adds the machine's measured read bandwidth to the header.

  .venv/bin/python scripts/bench/cpu_speed.py --model out/smollm2-135m-awq4 [--gguf F] [--llamacpp-bin DIR]
      [--repeats 3] [--parallel 8,16,32] [--prompts 128] [--dtype auto] [--threads T] [--no-hf] [--no-llamacpp]
      [--bandwidth] [--json PATH]

Each row is the median of --repeats runs; each repeat runs engine, llama.cpp, transformers in turn, so machine
noise hits them alike. Every engine request gets its own random prompt: prefix caching must not skip work.
llama.cpp figures come from llama-bench (pp/tg, one call with -r 1) and llama-batched-bench (all levels, one call).
Engine and transformers timings come from runtime/bench/timing.py, the core `compress bench` and `compress report`
use.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import random
import shlex
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

log = logging.getLogger(__name__)

SYSTEMS = ("engine", "llamacpp", "hf", "engine_fp")
PROMPT, GEN, TINY_PROMPT = 128, 128, 8  # tg128 in llama-bench starts from an empty context: a tiny prompt here


# --- pure helpers (unit-tested in tests/scripts/test_cpu_speed.py) ----------------------------------------------
@dataclass(frozen=True)
class Row:
    """One line of the table: a metric's median per system (None: not measured)."""

    label: str
    key: str
    engine: float | None
    llamacpp: float | None
    hf: float | None
    engine_fp: float | None = None  # the engine in fp32 on the fp model (batch-1 rows)

    @property
    def ratio(self) -> float | None:
        """engine / llama.cpp (above 1: the engine is faster)."""
        return None if self.engine is None or not self.llamacpp else self.engine / self.llamacpp


def metric_keys(levels: list[int], prompts: list[int] | tuple[int, ...] = (PROMPT,)) -> list[tuple[str, str]]:
    """(key, label) of every row, in table order."""
    keys = [(f"pp{p}", f"pp{p} tok/s") for p in prompts] + [(f"tg{GEN}", f"tg{GEN} tok/s")]
    for n in levels:
        keys += [(f"par{n}_out", f"parallel {n} out tok/s"), (f"par{n}_decode", f"parallel {n} decode tok/s")]
    return keys


def parse_levels(text: str, option: str = "--parallel", example: str = "8,16,32") -> list[int]:
    """'8,16,32' -> [8, 16, 32] (``option`` and ``example`` name the flag in the error)."""
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{option} {text!r} must list integers, e.g. {example}") from None
    if not levels or min(levels) < 1:
        raise ValueError(f"{option} {text!r} must list values >= 1, e.g. {example}")
    return levels


def parse_llama_bench(text: str) -> dict[str, float]:
    """llama-bench ``-o json`` -> {"pp128": tok/s, "tg128": tok/s} (avg_ts of each test)."""
    out = {}
    for t in json.loads(text):
        p, g = t["n_prompt"], t["n_gen"]  # both set: a -pg test, neither pure pp nor pure tg
        out[f"pp{p}" if not g else f"tg{g}" if not p else f"pp{p}+tg{g}"] = float(t["avg_ts"])
    return out


def parse_batched_bench(text: str) -> dict[str, float]:
    """llama-batched-bench ``--output-format jsonl`` -> {"parN_out": N*tg/(t_pp+t_tg), "parN_decode": S_TG}.

    Its own ``speed`` counts prompt tokens too; ``out`` counts only generated ones, as the engine's figure does.
    """
    out = {}
    for line in text.splitlines():
        if not line.startswith("{"):  # warnings may share the stream
            continue
        r = json.loads(line)
        n = int(r["pl"])
        out[f"par{n}_out"] = n * r["tg"] / (r["t_pp"] + r["t_tg"])
        out[f"par{n}_decode"] = float(r["speed_tg"])
    return out


def batched_ctx(levels: list[int], prompt: int = PROMPT, gen: int = GEN) -> int:
    """-c for llama-batched-bench: max N sequences of prompt+gen each, padded to 256 per sequence.

    It rounds any other -c up to a multiple of n_seq * 256 (warning 'rounding down'), e.g. 2304 -> 4096 for N=8.
    """
    return max(levels) * 256 * math.ceil((prompt + gen) / 256)


def build_rows(runs: dict[str, dict[str, list[float]]], levels: list[int],
               prompts: list[int] | tuple[int, ...] = (PROMPT,)) -> list[Row]:
    """runs[system][key] holds one number per repeat; a row holds their medians."""
    from runtime.bench.timing import median

    def med(system: str, key: str) -> float | None:
        return median(runs.get(system, {}).get(key, []))
    return [Row(label, key, med("engine", key), med("llamacpp", key), med("hf", key), med("engine_fp", key))
            for key, label in metric_keys(levels, prompts)]


def format_table(rows: list[Row]) -> str:
    """A markdown table; '-' where a system has no figure."""
    def cell(x: float | None, fmt: str = "{:.1f}") -> str:
        return "-" if x is None else fmt.format(x)
    lines = ["| metric | engine | llama.cpp | engine/llama.cpp | transformers fp32 | engine fp32 | engine fp32/transformers |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        fp_ratio = None if r.engine_fp is None or not r.hf else r.engine_fp / r.hf
        cells = [r.label, cell(r.engine), cell(r.llamacpp), cell(r.ratio, "{:.2f}x"), cell(r.hf), cell(r.engine_fp),
                 cell(fp_ratio, "{:.2f}x")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def sum_rate(nbytes: int, tries: int = 5, loops: int = 1) -> float:
    """Bytes/s of torch sums (current threads) over a float32 buffer of ``nbytes``, written first so its pages exist:
    the best of ``tries`` timings of ``loops`` sums each. The buffer lies in transparent huge pages where Linux offers
    them, as the engine holds its packed weights (runtime/hugepages.py): through 4 KiB pages the same sum streams
    slower, which would understate what the machine reads."""
    import torch

    from runtime.hugepages import arena

    buf = arena(nbytes // 4 * 4).view(torch.float32).fill_(1.0)
    best = math.inf
    for _ in range(tries):
        t0 = time.perf_counter()
        for _ in range(loops):
            buf.sum().item()
        best = min(best, (time.perf_counter() - t0) / loops)
    return buf.numel() * buf.element_size() / best


def read_bandwidth(gib: float = 1.0, tries: int = 5) -> float:
    """This machine's read bandwidth in bytes/s with torch's current threads: the best of ``tries`` sums over a
    ``gib`` GiB buffer, far larger than any cache. It is memory-bound only where the same sum runs faster in cache
    (``sum_rate(1 << 20, loops=1000)``): report both."""
    return sum_rate(int(gib * 2**30), tries)


def cpu_model_name(cpuinfo: str) -> str:
    """The 'model name' line of /proc/cpuinfo's text."""
    for line in cpuinfo.splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


# --- our engine ----------------------------------------------------------------------------------------------
def random_prompts(rng: random.Random, n: int, length: int) -> list[list[int]]:
    return [[rng.randrange(1000, 40000) for _ in range(length)] for _ in range(n)]


def drive(engine, sampling_cls, prompts: list[list[int]], max_tokens: int):
    """Submit every prompt at once, step until all are done (runtime/bench/timing.py, no KV accounting between
    steps); greedy, EOS ignored, so lengths are exact."""
    from runtime.bench.timing import run_engine
    from runtime.bench.workload import Request

    requests = [Request(tuple(p), max_tokens) for p in prompts]
    return run_engine(engine, requests, len(requests), False, sampling_cls, kv_slots=False)


def engine_repeat(engine, sampling_cls, rng: random.Random, levels: list[int],
                  prompts: list[int] | tuple[int, ...] = (PROMPT,)) -> dict[str, float]:
    """One repeat of every engine row (batch-1 rows only when ``levels`` is empty), each on fresh random prompts."""
    out = {}
    for p in prompts:
        t = drive(engine, sampling_cls, random_prompts(rng, 1, p), 1)
        out[f"pp{p}"] = p / t.first_token_at[0]
    t = drive(engine, sampling_cls, random_prompts(rng, 1, TINY_PROMPT), GEN)
    out[f"tg{GEN}"] = (GEN - 1) / (t.wall - t.first_token_at[0])
    for n in levels:
        t = drive(engine, sampling_cls, random_prompts(rng, n, PROMPT), GEN)
        out[f"par{n}_out"] = t.output_tokens / t.wall  # n * GEN tokens
        out[f"par{n}_decode"] = n * (GEN - 1) / (t.wall - max(t.first_token_at))  # after the last prompt is in
    return out


# --- llama.cpp -----------------------------------------------------------------------------------------------
def llamacpp_repeat(bin_dir: Path, gguf: Path, threads: int, levels: list[int],
                    prompts: list[int] | tuple[int, ...] = (PROMPT,)) -> dict[str, float]:
    def run(tool: str, *args: str) -> str:
        cmd = [str(bin_dir / tool), "-m", str(gguf), "-t", str(threads), *args]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode:
            raise RuntimeError(f"{shlex.join(cmd)} failed ({res.returncode}):\n{res.stderr[-2000:]}")
        return res.stdout
    pp = ",".join(map(str, prompts))
    out = parse_llama_bench(run("llama-bench", "-p", pp, "-n", str(GEN), "-r", "1", "-o", "json"))
    if not levels:
        return out
    lv = ",".join(map(str, levels))
    out |= parse_batched_bench(run("llama-batched-bench", "-c", str(batched_ctx(levels)), "-b", "2048", "-ub", "512",
                                   "-npp", str(PROMPT), "-ntg", str(GEN), "-npl", lv, "--output-format", "jsonl"))
    return out


# --- transformers --------------------------------------------------------------------------------------------
def hf_repeat(model, rng: random.Random) -> dict[str, float]:
    import torch

    from runtime.bench.timing import StepClock

    with torch.inference_mode():
        ids = torch.tensor(random_prompts(rng, 1, PROMPT))
        t0 = time.perf_counter()
        model(input_ids=ids)
        pp = PROMPT / (time.perf_counter() - t0)
        clock = StepClock()
        ids = torch.tensor(random_prompts(rng, 1, TINY_PROMPT))
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=GEN, min_new_tokens=GEN,
                       do_sample=False, streamer=clock, pad_token_id=0)
    steps = clock.steps
    assert len(steps) == GEN, (len(steps), GEN)
    return {f"pp{PROMPT}": pp, f"tg{GEN}": (GEN - 1) / (steps[-1] - steps[0])}


# --- the run -------------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="engine checkpoint folder (or any spec the engine takes)")
    ap.add_argument("--gguf", help="llama.cpp model; default: the embedded SmolLM2 Q4_1 GGUF")
    ap.add_argument("--llamacpp-bin", help="folder with llama-bench etc.; default: built by scripts/bench/llamacpp.sh")
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers fp32 rows")
    ap.add_argument("--no-llamacpp", action="store_true")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--parallel", default="8,16,32", help="concurrent sequences per level, e.g. 8,16,32")
    ap.add_argument("--prompts", default=str(PROMPT), help="prompt lengths of the batch-1 prompt rows, e.g. 128,512")
    ap.add_argument("--bandwidth", action="store_true", help="measure the machine's read bandwidth (1 GiB sums)")
    ap.add_argument("--dtype", default="auto", help="engine dtype (auto, float32, bfloat16, ...)")
    ap.add_argument("--lm-head", default="auto", help="engine LM head on CPU: auto, fp, int8, int4")
    ap.add_argument("--fp-model", default="smollm2-135m",
                    help="fp model for the 'engine fp32' batch-1 column (against transformers); '' to skip")
    ap.add_argument("--threads", type=int, help="torch and llama.cpp threads; default: torch.get_num_threads()")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write config, machine, raw per-repeat numbers and rows here")
    return ap.parse_args(argv)


def llamacpp_paths(a: argparse.Namespace) -> tuple[Path, Path]:
    """(GGUF, folder of llama.cpp tools) from the options, defaulting to the embedded SmolLM2 and llamacpp.sh."""
    if a.gguf:
        gguf = Path(a.gguf)
    else:
        from compress.format.models import resolve

        src = resolve("smollm2-135m")
        gguf = src.path / src.gguf_file
    if not gguf.is_file():
        raise SystemExit(f"--gguf {gguf} is not a file")
    return gguf, llamacpp_bin_dir(a.llamacpp_bin)


def llamacpp_bin_dir(given: str | None) -> Path:
    """The folder of llama.cpp's tools: ``given``, else the one scripts/bench/llamacpp.sh builds once and caches."""
    if given:
        return Path(given)
    build = subprocess.run(["bash", str(Path(__file__).resolve().parent / "llamacpp.sh")], check=True,
                           capture_output=True, text=True)  # builds once, then only prints the cached folder
    return Path(build.stdout.strip().splitlines()[-1])


def build_engine(model: str, dtype: str, max_seqs: int, lm_head: str = "auto"):
    from runtime.config import EngineConfig
    from runtime.engine import Engine

    try:
        cfg = EngineConfig(model=model, dtype=dtype, max_num_seqs=max_seqs, kv_cache_memory=1 << 30, lm_head=lm_head)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    return Engine(cfg)


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    try:
        levels = parse_levels(a.parallel)
        prompts = parse_levels(a.prompts, "--prompts", "128,512")
    except ValueError as e:
        raise SystemExit(str(e)) from None
    if a.repeats < 1:
        raise SystemExit(f"--repeats {a.repeats} must be >= 1")
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a file from anywhere
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    import torch

    from runtime.sequence import SamplingParams

    if a.threads:
        torch.set_num_threads(a.threads)
    threads = torch.get_num_threads()
    gguf, bin_dir = (None, None) if a.no_llamacpp else llamacpp_paths(a)
    rng = random.Random(a.seed)

    log.info("building the engine on %s (dtype=%s, max_num_seqs=%d)", a.model, a.dtype, max(levels))
    engine = build_engine(a.model, a.dtype, max(levels), a.lm_head)
    dtype_used, head_used = engine.dtype, engine.runner.lm_head_kind
    drive(engine, SamplingParams, random_prompts(rng, 1, max(prompts)), 4)  # first-call costs out: a long prefill,
    drive(engine, SamplingParams, random_prompts(rng, min(levels), 16), 4)  # a batched decode
    hf = None
    if not a.no_hf:
        from compress.format.models import load_model

        hf = load_model("smollm2-135m")[0].float().eval()
        hf_repeat(hf, rng)  # warm-up

    todo = {"engine": lambda: engine_repeat(engine, SamplingParams, rng, levels, prompts)}
    if a.fp_model:
        fp_engine = build_engine(a.fp_model, "float32", 1, "fp")
        drive(fp_engine, SamplingParams, random_prompts(rng, 1, PROMPT), 4)
        todo["engine_fp"] = lambda: engine_repeat(fp_engine, SamplingParams, rng, [])
    if bin_dir is not None:
        todo["llamacpp"] = lambda: llamacpp_repeat(bin_dir, gguf, threads, levels, prompts)
    if hf is not None:
        todo["hf"] = lambda: hf_repeat(hf, rng)
    load_before = os.getloadavg()[0]  # other work on the machine skews every figure: say how busy it was
    bandwidth = read_bandwidth() if a.bandwidth else None
    runs = interleave(todo, a.repeats)
    rows = build_rows(runs, levels, prompts)
    meta = {"cpu": cpu_model_name(Path("/proc/cpuinfo").read_text()) if Path("/proc/cpuinfo").is_file() else "?",
            "threads": threads, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "engine_dtype": dtype_used,
            "engine_lm_head": head_used, "engine_cpu_ops": engine.runner.ops.name,
            "requested_dtype": a.dtype, "command": shlex.join([sys.executable, *sys.argv]), "model": a.model,
            "gguf": gguf and str(gguf), "llamacpp_bin": bin_dir and str(bin_dir), "repeats": a.repeats,
            "parallel": levels, "prompts": prompts, "torch": torch.__version__,
            "read_bandwidth_gbs": bandwidth and bandwidth / 1e9, "loadavg_1min": [load_before, os.getloadavg()[0]]}
    report(meta, rows, runs, a.json)


def interleave(todo: dict, repeats: int) -> dict[str, dict[str, list[float]]]:
    """Each repeat runs every system in turn, so machine noise hits them alike; runs[system][key]: one per repeat."""
    runs: dict[str, dict[str, list[float]]] = {s: {} for s in (*SYSTEMS, *todo)}
    for i in range(repeats):
        for system, fn in todo.items():
            log.info("repeat %d/%d: %s", i + 1, repeats, system)
            for key, v in fn().items():
                runs[system].setdefault(key, []).append(v)
    return runs


def report(meta: dict, rows: list[Row], runs: dict, json_path: str | None) -> None:
    """The machine line, the command and the table on stdout; everything as JSON at ``json_path``."""
    print(f"CPU: {meta['cpu']} | threads: {meta['threads']} | date: {meta['date']} | engine dtype: "
          f"{meta['engine_dtype']} (requested {meta['requested_dtype']}), lm_head {meta['engine_lm_head']}, ops "
          f"{meta['engine_cpu_ops']} | medians of {meta['repeats']} repeat(s) | load avg {meta['loadavg_1min'][0]:.1f} "
          f"-> {meta['loadavg_1min'][1]:.1f}" + (f" | read bandwidth {meta['read_bandwidth_gbs']:.1f} GB/s"
                                                 if meta.get("read_bandwidth_gbs") else ""))
    print(f"command: {meta['command']}")
    print(format_table(rows))
    if json_path:
        rows_out = [asdict(r) | {"ratio": r.ratio} for r in rows]
        Path(json_path).write_text(json.dumps({"meta": meta, "runs": runs, "rows": rows_out}, indent=2))
        log.info("wrote %s", json_path)


if __name__ == "__main__":
    main()
