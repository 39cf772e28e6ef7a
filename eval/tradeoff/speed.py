"""A variant's speed in the runtime that serves it: this engine for checkpoints, ONNX Runtime for ONNX
exports, llama.cpp (when built by scripts/bench/llamacpp.sh) for GGUF files. Every runtime gets the same
work: prompts of ``prompt_len`` tokens, ``output_len`` new tokens each, EOS ignored; TTFT and TPOT at
batch 1, output tokens per second at ``concurrency`` requests at once. The engine is timed by
runtime/bench/timing.py (the measurement ``compress bench`` uses), ONNX Runtime's medians come from it too."""
from __future__ import annotations

import gc
import glob
import json
import os
import subprocess
import time
from pathlib import Path

from runtime.bench.timing import median

BATCH1_REQUESTS = 3  # sequential requests timed at batch 1 (medians)
KV_CACHE_MEMORY = 1 << 28


def torch_threads() -> int:
    """The threads every runtime gets: torch's (OMP_NUM_THREADS), so the rows compare like with like."""
    import torch

    return torch.get_num_threads()


def workload(tokenizer, n: int, cfg, seed: int):
    """``n`` requests of the report's prompt and output lengths (the same for every runtime at one seed)."""
    from runtime.bench.workload import make_requests

    return make_requests(tokenizer, n, cfg.prompt_len, cfg.output_len, jitter=0.0, seed=seed)


def engine_speed(spec: str, cfg) -> dict:
    """This engine (runtime/): batch-1 TTFT/TPOT and continuous-batching throughput at ``cfg.concurrency``."""
    from runtime.bench.timing import run_engine, summarize
    from runtime.config import EngineConfig
    from runtime.engine import Engine
    from runtime.model_runner import kv_bytes_per_block
    from runtime.sequence import SamplingParams

    engine = Engine(EngineConfig(model=spec, max_num_seqs=cfg.concurrency, kv_cache_memory=KV_CACHE_MEMORY))
    try:
        tok = engine.tokenizer
        warm = workload(tok, 1, cfg, seed=1)
        run_engine(engine, warm, 1, False, SamplingParams)  # compile/allocate once, outside the timings
        one = summarize("batch1", spec, 1, [run_engine(engine, workload(tok, BATCH1_REQUESTS, cfg, 2), 1, False,
                                                          SamplingParams)])
        many = summarize("parallel", spec, cfg.concurrency, [run_engine(
            engine, workload(tok, 2 * cfg.concurrency, cfg, 3), cfg.concurrency, False, SamplingParams)])
        kv = kv_bytes_per_block(engine.runner.config, 1, engine.dtype)  # the engine's default KV cache
        return {"runtime": f"engine {engine.dtype}", "ttft_ms": one.ttft_ms_p50, "tpot_ms": one.tpot_ms_p50,
                "decode_tok_s": 1000.0 / one.tpot_ms_p50, "output_tok_s": many.output_tok_s,
                "concurrency": cfg.concurrency, "kv_bytes_per_token": kv}
    finally:
        del engine
        gc.collect()


def onnx_speed(path: str, cfg) -> dict:
    """ONNX Runtime through compress/exporters/onnx_runner.py: greedy steps with the KV cache as I/O."""
    import numpy as np
    import torch

    from compress.exporters.onnx_runner import OnnxCausalLM
    from transformers import AutoTokenizer

    model, tok = OnnxCausalLM(path, threads=torch_threads()), AutoTokenizer.from_pretrained(path)
    ttft, tpot = [], []
    for r in workload(tok, 1, cfg, 1) + workload(tok, BATCH1_REQUESTS, cfg, 2):  # the first warms up
        ids = np.asarray([r.prompt_ids], dtype=np.int64)
        mask, past = np.ones_like(ids), model._empty_past(1)
        t0 = time.perf_counter()
        logits, past = model.step(ids, mask, past)
        t1 = time.perf_counter()
        for _ in range(r.output_len - 1):
            nxt = logits[:, -1].argmax(-1)[:, None].astype(np.int64)
            mask = np.concatenate([mask, np.ones_like(nxt)], axis=1)
            logits, past = model.step(nxt, mask, past)
        ttft.append(t1 - t0)
        tpot.append((time.perf_counter() - t1) / (r.output_len - 1))
    reqs = workload(tok, cfg.concurrency, cfg, 3)  # one static batch: ONNX Runtime has no scheduler
    t0 = time.perf_counter()
    model.generate(torch.tensor([r.prompt_ids for r in reqs]), max_new_tokens=cfg.output_len)
    wall = time.perf_counter() - t0
    ttft_ms, tpot_ms = 1000 * median(ttft[1:]), 1000 * median(tpot[1:])
    kv = 2 * model.n_layers * model.kv_heads * model.head_dim * np.dtype(model.np_dtype).itemsize
    return {"runtime": "onnxruntime", "ttft_ms": ttft_ms, "tpot_ms": tpot_ms, "decode_tok_s": 1000.0 / tpot_ms,
            "output_tok_s": cfg.concurrency * cfg.output_len / wall, "concurrency": cfg.concurrency,
            "kv_bytes_per_token": kv, "note": "static batch at concurrency"}


def llamacpp_bin() -> Path | None:
    """The folder scripts/bench/llamacpp.sh builds llama.cpp's bench tools into, if it has been run."""
    root = os.environ.get("COMPRESS_CACHE") or str(Path.home() / ".cache" / "compress")
    found = sorted(glob.glob(str(Path(root) / "llama.cpp-*" / "bin" / "llama-bench")))
    return Path(found[-1]).parent if found else None


def _run(tool: Path, *args: str) -> str:
    proc = subprocess.run([str(tool), *args], capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"{tool.name} failed ({proc.returncode}): {proc.stderr.strip()[-300:]}")
    return proc.stdout


def llamacpp_speed(path: str, cfg) -> dict:
    """llama.cpp's llama-bench (prompt and batch-1 decode) and llama-batched-bench (``concurrency`` sequences)."""
    bin_dir = llamacpp_bin()
    if bin_dir is None:
        raise FileNotFoundError("llama.cpp is not built: run scripts/bench/llamacpp.sh (once, ~7 minutes) "
                                "to time GGUF variants")
    threads = str(torch_threads())
    tests = {"tg" if t["n_gen"] else "pp": float(t["avg_ts"]) for t in json.loads(_run(
        bin_dir / "llama-bench", "-m", path, "-p", str(cfg.prompt_len), "-n", str(cfg.output_len), "-r", "2",
        "-t", threads, "-o", "json"))}
    n = cfg.concurrency
    ctx = n * 256 * -(-(cfg.prompt_len + cfg.output_len) // 256)  # it rounds -c to n * 256 per sequence
    rows = [json.loads(x) for x in _run(bin_dir / "llama-batched-bench", "-m", path, "-c", str(ctx), "-b", "2048",
                                         "-ub", "512", "-npp", str(cfg.prompt_len), "-ntg", str(cfg.output_len),
                                         "-npl", str(n), "-t", threads, "--output-format", "jsonl").splitlines()
            if x.startswith("{")]
    par = next(r for r in rows if r.get("pl") == n)
    return {"runtime": "llama.cpp", "ttft_ms": 1000.0 * cfg.prompt_len / tests["pp"], "tpot_ms": 1000.0 / tests["tg"],
            "decode_tok_s": tests["tg"], "output_tok_s": n * cfg.output_len / (par["t_pp"] + par["t_tg"]),
            "concurrency": n, "kv_bytes_per_token": None, "note": "TTFT from llama-bench's prompt rate"}


def measure_speed(spec: str, cfg) -> dict:
    """The runtime that fits the artifact: ONNX folder, GGUF file, else this engine."""
    from compress.exporters.onnx_runner import is_onnx_folder

    if is_onnx_folder(spec):
        return onnx_speed(spec, cfg)
    if spec.endswith(".gguf"):
        return llamacpp_speed(spec, cfg)
    return engine_speed(spec, cfg)
