"""Where one batch-1 decode step goes: torch profiler over decode steps, self CPU time grouped by kind, for the
torch reference path and the fused CPU path side by side (same checkpoint, same prompts), the int4 linears with
bf16 activations (aten's int4pack) and with int8 activations (the W8A8 VNNI kernel, where the CPU has it).

  .venv/bin/python scripts/bench/decode_profile.py out/smollm2-135m-awq4 [--steps 32]

Profiler overhead inflates the many small ops of the torch path, so read the wall column for speed and the
shares for where the time goes.
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

GROUPS = [  # (label, substrings of op names), first match wins
    ("native step (all layers, one call)", ("DecodeStep",)),
    ("int4/int8 matmuls", ("int4pack", "int8pack", "int8_linear", "w8a8_linear")),
    ("bf16 GEMM (oneDNN, F.linear)", ("mkldnn", "aten::mm", "aten::addmm", "aten::linear")),
    ("attention", ("attention", "index_select", "index_copy")),
    ("norms, rotary, activations", ("rms_norm", "rope", "act_mul", "silu", "roll", "aten::mul", "aten::add", "aten::pow",
                                    "aten::mean", "aten::rsqrt", "aten::div", "aten::sum", "aten::neg", "aten::cat")),
]


def profile(model: str, fused: bool, lm_head: str, int8_act: bool, steps: int,
            native: bool = False) -> tuple[dict[str, float], float]:
    import torch
    from torch.profiler import ProfilerActivity, profile as torch_profile

    from runtime.config import EngineConfig
    from runtime.engine import Engine
    from runtime.kernels import w8a8
    from runtime.sequence import SamplingParams

    vnni = w8a8.available
    if not int8_act:
        w8a8.available = lambda: False  # the path a CPU without VNNI runs

    rng = random.Random(0)
    engine = Engine(EngineConfig(model=model, max_num_seqs=1, kv_cache_memory=1 << 28, lm_head=lm_head,
                                 fused_cpu_kernels=fused, native_decode_step=native))
    w8a8.available = vnni
    step = engine.runner.model.native_step
    if step is not None:  # a custom class's method is no dispatcher op: name it for the profiler
        run = step._run

        def named(*args):
            with torch.profiler.record_function("DecodeStep.run"):
                return run(*args)
        step._run = named
    params = SamplingParams(temperature=0.0, max_tokens=2 * steps + 8, ignore_eos=True)
    engine.add_request([rng.randrange(1000, 40000) for _ in range(128)], params)
    for _ in range(4):
        engine.step()
    tick = time.perf_counter()
    for _ in range(steps):
        engine.step()
    wall = (time.perf_counter() - tick) / steps * 1e3
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.step()
    groups = {label: 0.0 for label, _ in GROUPS} | {"other (dispatch, Python, small ops)": 0.0}
    total = 0.0
    for ev in prof.key_averages():
        ms = ev.self_cpu_time_total / 1e3 / steps
        total += ms
        label = next((g for g, keys in GROUPS if any(k in ev.key for k in keys)), "other (dispatch, Python, small ops)")
        groups[label] += ms
    return {k: v / total for k, v in groups.items()}, wall


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--native-only", action="store_true", help="profile the native decode step alone")
    a = ap.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    runs = [("torch ops, fp head", False, "fp", False),
            ("fused, int8 head, bf16 activations (int4pack)", True, "int8", False),
            ("fused, int8 head, int8 activations (w8a8)", True, "int8", True),
            ("fused, int4 head, int8 activations (w8a8)", True, "int4", True)]
    runs = [(*r, False) for r in runs] + [("native step, int8 head, int8 activations (w8a8)", True, "int8", True, True)]
    if a.native_only:
        runs = runs[-1:]
    results = [(name, *profile(a.model, fused, head, act, a.steps, native))
               for name, fused, head, act, native in runs]
    print(f"{a.model}: one decode step at batch 1 (context ~140 tokens), {a.steps} steps")
    print("| path | step ms (wall) | " + " | ".join(results[0][1]) + " |")
    print("|---|---:|" + "---:|" * len(results[0][1]))
    for name, shares, wall in results:
        cells = [f"{wall * s:.2f} ms ({100 * s:.0f}%)" for s in shares.values()]
        print(f"| {name} | {wall:.2f} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
