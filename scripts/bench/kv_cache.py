"""The 8-bit KV cache against the default (compute-dtype) cache on one checkpoint, side by side in one run:
held-out perplexity through the engine's paged path, greedy equality over held-out prompts, sequences admitted at
the same KV memory, and decode tok/s at N concurrent sequences (medians of alternating repeats).

  .venv/bin/python scripts/bench/kv_cache.py out/smollm2-135m-awq4 [--kv int8] [--ppl wiki] [--max-windows 8]
      [--ppl-mode decode] [--prompts 20] [--gen 48] [--greedy-variants torch-ops,fp-head,fp8_e4m3]
      [--parallel 32] [--repeats 3] [--threads N] [--dtype auto|float32|bfloat16] [--sections ppl,greedy,decode]
      [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

import torch


def held_out_prompts(texts: list[str], n: int, words: int = 24) -> list[str]:
    """The first ``words`` words of the first ``n`` held-out paragraphs long enough to have them."""
    out = []
    for t in texts:
        w = t.split()
        if len(w) >= words:
            out.append(" ".join(w[:words]))
        if len(out) == n:
            break
    return out


def admitted(num_blocks: int, block_size: int, prompt_len: int, offered: int = 4096) -> int:
    """Sequences the scheduler admits at once into ``num_blocks`` blocks when ``offered`` prompts of ``prompt_len``
    tokens wait (no limit on batch size or tokens: only the KV pool decides)."""
    from runtime.block_manager import BlockManager
    from runtime.scheduler import Scheduler
    from runtime.sequence import SamplingParams, Sequence

    sched = Scheduler(BlockManager(num_blocks, block_size, enable_prefix_caching=False), offered, 1 << 30)
    for i in range(offered):
        sched.add(Sequence(f"r{i}", [1 + i % 1000] * prompt_len, SamplingParams()))
    sched.schedule()
    return len(sched.running)


# greedy-only variants that put the int8 cache's forks in scale: other roundings of the same bf16 model
VARIANTS = {"torch-ops": {"fused_cpu_kernels": False}, "fp-head": {"lm_head": "fp"},
            "fp8_e4m3": {"kv_cache_dtype": "fp8_e4m3"}}


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def greedy_agreement(ref: list[list[int]], other: list[list[int]]) -> dict:
    """How many continuations equal the reference's, whole and over the first 16 tokens; mean common prefix."""
    prefix = [common_prefix(x, y) for x, y in zip(ref, other)]
    return {"equal": sum(x == y for x, y in zip(ref, other)), "first16_equal": sum(p >= 16 for p in prefix),
            "mean_common_prefix": statistics.mean(prefix)}


def measure_ppl(a, texts: list[str], kinds: list[str]) -> dict:
    from eval.perplexity import perplexity
    from runtime.lm import EngineLM

    out = {}
    for kv in kinds:
        lm = EngineLM(a.model, dtype=a.dtype, mode=a.ppl_mode, max_len=a.seqlen, kv_cache_dtype=kv)
        out[kv] = perplexity(lm, lm.tokenizer, texts, seqlen=a.seqlen, max_windows=a.max_windows, batch_size=4).ppl
        print(f"ppl {kv}: {out[kv]:.4f}", flush=True)
    return out


def measure_greedy(a, engines: dict, texts: list[str], variants: list[str]) -> dict:
    """Agreement of each cache (and each variant) with the default cache's greedy tokens on held-out prompts."""
    from runtime.config import EngineConfig
    from runtime.engine import Engine
    from runtime.sequence import SamplingParams

    prompts = held_out_prompts(texts, a.prompts)
    greedy = SamplingParams(max_tokens=a.gen, ignore_eos=True)
    outs = {kv: [o.token_ids for o in e.generate(prompts, greedy)] for kv, e in engines.items()}
    for name in variants:
        engine = Engine(EngineConfig(model=a.model, dtype=a.dtype, kv_cache_memory=a.kv_memory, **VARIANTS[name]))
        outs[name] = [o.token_ids for o in engine.generate(prompts, greedy)]
    res = {name: greedy_agreement(outs["auto"], o) for name, o in outs.items() if name != "auto"}
    for name, g in res.items():
        print(f"greedy {name}: {g['equal']}/{len(prompts)} prompts give auto's {a.gen} tokens, "
              f"{g['first16_equal']} its first 16 (mean common prefix {g['mean_common_prefix']:.1f})", flush=True)
    return res


def measure_decode(a, engines: dict) -> dict[str, list[float]]:
    """Decode tok/s at ``a.parallel`` concurrent sequences per repeat, alternating which cache goes first."""
    from cpu_speed import GEN, PROMPT, drive, random_prompts
    from runtime.sequence import SamplingParams

    kinds, rng = list(engines), random.Random(0)
    runs: dict[str, list[float]] = {kv: [] for kv in kinds}
    for r in range(a.repeats):
        for kv in (kinds if r % 2 == 0 else kinds[::-1]):
            t = drive(engines[kv], SamplingParams, random_prompts(rng, a.parallel, PROMPT), GEN)
            runs[kv].append(a.parallel * (GEN - 1) / (t.end - max(t.first)))
            print(f"decode {kv} repeat {r}: {runs[kv][-1]:.1f} tok/s", flush=True)
    return runs


def print_table(a, res: dict, dtype: str) -> None:
    from cpu_speed import GEN, PROMPT

    q = a.kv
    print(f"\n{a.model}: KV cache {q} vs auto ({dtype}), {a.kv_memory >> 20} MiB pool, "
          f"{torch.get_num_threads()} threads")
    print(f"| metric | auto | {q} | {q}/auto |\n|---|---:|---:|---:|")
    rows = [(f"held-out {a.ppl} ppl ({a.max_windows} x {a.seqlen}, engine {a.ppl_mode})", res.get("ppl"), "{:.3f}"),
            (f"KV blocks of 16 tokens in {a.kv_memory >> 20} MiB", res["blocks"], "{}"),
            (f"sequences of {PROMPT + GEN} tokens admitted", res["admitted"], "{}"),
            (f"decode tok/s, {a.parallel} concurrent (median of {a.repeats})", res.get("decode_tok_s"), "{:.1f}")]
    for label, d, fmt in rows:
        if d:
            print(f"| {label} | {fmt.format(d['auto'])} | {fmt.format(d[q])} | {d[q] / d['auto']:.4f} |")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--kv", default="int8", help="the 8-bit cache dtype to compare with auto")
    ap.add_argument("--sections", default="ppl,greedy,decode", help="what to measure (capacity always)")
    ap.add_argument("--ppl", default="wiki")
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--max-windows", type=int, default=8)
    ap.add_argument("--ppl-mode", default="decode", help="EngineLM mode: decode (token by token) or prefill")
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--gen", type=int, default=48)
    ap.add_argument("--greedy-variants", default="", help=f"also compare these with auto's greedy: {list(VARIANTS)}")
    ap.add_argument("--parallel", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="auto", help="compute dtype of every engine (float32: no bf16 rounding "
                    "between the caches compared, so only the cache's own error can fork a greedy continuation)")
    ap.add_argument("--kv-memory", type=int, default=256 << 20, help="bytes of each KV pool")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    here = Path(__file__).resolve()
    sys.path[:0] = [str(here.parents[2]), str(here.parent)]
    from cpu_speed import GEN, PROMPT

    from compress.data import load_texts
    from runtime.config import EngineConfig
    from runtime.engine import Engine

    if a.threads:
        torch.set_num_threads(a.threads)
    sections, kinds = a.sections.split(","), ["auto", a.kv]
    variants = [v for v in a.greedy_variants.split(",") if v]
    if unknown := set(variants) - set(VARIANTS):
        raise SystemExit(f"--greedy-variants {sorted(unknown)} unknown; use some of {list(VARIANTS)}")
    texts = load_texts(a.ppl, "eval")
    res: dict = {"args": vars(a)}
    if "ppl" in sections:
        res["ppl"] = measure_ppl(a, texts, kinds)
    engines = {kv: Engine(EngineConfig(model=a.model, dtype=a.dtype, kv_cache_dtype=kv, kv_cache_memory=a.kv_memory,
                                       max_num_seqs=max(64, a.parallel))) for kv in kinds}
    res["blocks"] = {kv: e.block_manager.num_blocks for kv, e in engines.items()}
    res["admitted"] = {kv: admitted(n, engines[kv].config.block_size, PROMPT + GEN) for kv, n in res["blocks"].items()}
    if "greedy" in sections:
        res["greedy"] = measure_greedy(a, engines, texts, variants)
    if "decode" in sections:
        res["decode_runs"] = measure_decode(a, engines)
        res["decode_tok_s"] = {kv: statistics.median(v) for kv, v in res["decode_runs"].items()}
    print_table(a, res, str(engines["auto"].dtype))
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
