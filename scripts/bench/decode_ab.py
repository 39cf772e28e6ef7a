"""Batch-1 greedy decode of two or more engine checkpoints, interleaved run by run so a shared machine's noise hits
each alike; prints each one's median tok/s and the ratios to the first.

    OMP_NUM_THREADS=1 python scripts/bench/decode_ab.py out/smollm2-rtn4 out/smollm2-nf4 --threads 1 --repeats 3

``--off FLAG`` also runs each checkpoint with that boolean EngineConfig field False, in the same interleaving
(``--off native_decode_step``: the per-op decode path against the native step).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))


def main() -> None:
    import torch

    from runtime import LLM, SamplingParams

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="+")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--off", action="append", default=[], metavar="FLAG",
                    help="also run each model with this boolean EngineConfig field False")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    llms = {}
    for m in args.models:
        llms[m] = LLM(m)
        for flag in args.off:
            llms[f"{m} [{flag}=False]"] = LLM(m, **{flag: False})
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    rates: dict[str, list[float]] = {m: [] for m in llms}
    for _ in range(args.repeats):
        for m, llm in llms.items():
            t = time.perf_counter()
            out = llm.generate(["The history of the city begins"], params)
            rates[m].append(len(out[0].token_ids) / (time.perf_counter() - t))
    first = statistics.median(rates[next(iter(llms))])
    for m, r in rates.items():
        med = statistics.median(r)
        print(f"{m}: {med:.1f} tok/s median of {[round(x, 1) for x in r]}, {med / first:.3f}x the first")


if __name__ == "__main__":
    main()
