"""Startup memory and speed of one engine checkpoint, in a fresh process: the RSS of python + torch + the runtime's
imports before anything is read, VmHWM (peak) and VmRSS once ``LLM(model)`` is up, then optionally the prompt
speed of a 512-token prompt and batch-1 greedy decode speed. Run it per checkpoint (or per code tree), alternating,
and take medians:

    OMP_NUM_THREADS=1 python scripts/bench/startup_memory.py out/smollm2-rtn4 --speed --option quant_kernel=hybrid
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))


def status_mib() -> dict[str, float]:
    """VmRSS, VmHWM, RssAnon and RssFile of this process in MiB (/proc/self/status)."""
    with open("/proc/self/status") as f:
        rows = [line.split(":") for line in f if line.startswith(("VmRSS", "VmHWM", "RssAnon", "RssFile"))]
    return {k: int(v.split()[0]) / 1024 for k, v in rows}


def speed(llm, tokens: int = 128, prompt_len: int = 512, repeats: int = 3) -> dict[str, float]:
    """Median prompt tok/s of ``repeats`` distinct ``prompt_len``-token prompts, then batch-1 greedy decode tok/s."""
    import statistics

    import torch

    from runtime import SamplingParams

    ids = torch.randint(100, 40000, (prompt_len,), generator=torch.Generator().manual_seed(0)).tolist()
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    llm.generate([ids[:64]], one)  # warm up
    rates = []
    for i in range(repeats):
        t = time.perf_counter()
        llm.generate([[ids[0] + i + 1] + ids[1:]], one)  # a new first token: no prefix-cache hit
        rates.append(prompt_len / (time.perf_counter() - t))
    t = time.perf_counter()
    out = llm.generate(["The history of the city begins"], SamplingParams(max_tokens=tokens, temperature=0.0,
                                                                          ignore_eos=True))
    return {"prefill_tok_s": statistics.median(rates), "decode_tok_s": len(out[0].token_ids) / (time.perf_counter() - t)}


def main() -> None:
    import torch

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--option", action="append", default=[], help="an EngineConfig field, key=value (JSON value)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--speed", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from runtime import LLM
    from runtime.kernels.fused import select_ops

    options = {}
    for kv in args.option:
        key, _, value = kv.partition("=")
        try:
            options[key] = json.loads(value)
        except json.JSONDecodeError:
            options[key] = value
    select_ops("cpu", torch.bfloat16, True)  # the CPU kernels' library belongs to the baseline
    result = {"model": args.model, "options": options, "threads": args.threads, "baseline": status_mib()}
    t = time.perf_counter()
    llm = LLM(args.model, **options)
    result.update(load_s=time.perf_counter() - t, startup=status_mib())
    if args.speed:
        result.update(speed(llm), after=status_mib())
    print(json.dumps(result))


if __name__ == "__main__":
    main()
