"""ONNX Runtime CPU speed of exported decoders, side by side in one run: prompt processing (TTFT) and
batch-1 greedy decode tokens/s, alternating the models round by round so machine noise hits them alike.

  .venv/bin/python scripts/bench/onnx_speed.py out/awq4-onnx out/awq4-onnx-int4 [--prompt 128] [--new 128]
      [--rounds 5] [--threads 2]

Prints one markdown row per folder (medians over rounds) and the ratio to the first folder.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def one_run(model, prompt: np.ndarray, new: int) -> tuple[float, float]:
    """(seconds to the first token, decode tokens/s over the remaining new - 1 tokens); EOS ignored."""
    mask = np.ones_like(prompt)
    t0 = time.perf_counter()
    logits, past = model.step(prompt, mask, model._empty_past(1))
    ttft = time.perf_counter() - t0
    nxt = logits[:, -1].argmax(-1)[:, None].astype(np.int64)
    t1 = time.perf_counter()
    for _ in range(new - 1):
        mask = np.concatenate([mask, np.ones_like(nxt)], axis=1)
        logits, past = model.step(nxt, mask, past)
        nxt = logits[:, -1].argmax(-1)[:, None].astype(np.int64)
    return ttft, (new - 1) / (time.perf_counter() - t1)


def main():
    from compress.exporters.onnx_runner import OnnxCausalLM

    ap = argparse.ArgumentParser()
    ap.add_argument("folders", nargs="+")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    models = {f: OnnxCausalLM(f, threads=a.threads) for f in a.folders}
    vocab = next(iter(models.values())).config.vocab_size
    prompt = np.random.default_rng(0).integers(0, vocab, size=(1, a.prompt), dtype=np.int64)
    for m in models.values():  # warm-up: first runs allocate and pick kernels
        one_run(m, prompt, 8)
    res: dict[str, list[tuple[float, float]]] = {f: [] for f in a.folders}
    for _ in range(a.rounds):
        for f, m in models.items():
            res[f].append(one_run(m, prompt, a.new))
    first = None
    print(f"| folder | size MiB | TTFT ms ({a.prompt} tokens) | prompt tok/s | decode tok/s | decode vs first |")
    print("|---|---|---|---|---|---|")
    for f, runs in res.items():
        ttft = statistics.median(r[0] for r in runs)
        dec = statistics.median(r[1] for r in runs)
        first = first or dec
        size = sum(p.stat().st_size for p in Path(f).glob("*.onnx*")) / 2**20
        print(f"| {f} | {size:.0f} | {ttft * 1e3:.0f} | {a.prompt / ttft:.0f} | {dec:.1f} | {dec / first:.2f}x |")


if __name__ == "__main__":
    main()
