"""Structured output's cost: the grammar engines' mask time per token with SmolLM2's tokenizer, and the engine's
decoding speed with a JSON-schema constraint against unconstrained, at batch 1 and at 16 concurrent requests.

  .venv/bin/python scripts/bench/guided.py mask              # xgrammar vs llguidance (llguidance: pip install it)
  .venv/bin/python scripts/bench/guided.py cost [--model smollm2-135m] [--tokens 48] [--rounds 3]

``mask`` times ``fill_next_token_bitmask`` alone on random walks under the mask (one thread); ``cost`` alternates
constrained and unconstrained runs (the first run of a process warms kernels up and is dropped) and reports each
side's best run, since a shared CPU only ever makes a run slower: output tok/s over the whole run, and TPOT (a
request's time from its first token to its last, per token after the first: a JSON answer that closes before
``--tokens`` would otherwise spread its prompt's prefill over fewer tokens).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags", "city"], "properties": {
    "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "bb", "ccc"]}, "maxItems": 4},
    "city": {"type": "string"}}}


def _walks(new, fill, accept, done, vocab: int, walks: int = 5, steps: int = 60) -> list[float]:
    """Seconds per mask over random walks that only take allowed tokens."""
    import numpy as np
    import torch

    g, times = torch.Generator().manual_seed(0), []
    for _ in range(walks):
        m = new()
        for _ in range(steps):
            if done(m):
                break
            t0 = time.perf_counter()
            words = fill(m)
            times.append(time.perf_counter() - t0)
            allowed = np.unpackbits(words.numpy().view(np.uint8), bitorder="little")[:vocab]
            scores = torch.rand(vocab, generator=g).masked_fill_(torch.from_numpy(allowed) == 0, -1)
            accept(m, int(scores.argmax()))
    return sorted(times)


def mask(_args) -> None:
    from compress.format.models import load_tokenizer, resolve

    tok = load_tokenizer(resolve("smollm2-135m"))
    vocab = len(tok)
    import xgrammar as xgr

    t0 = time.perf_counter()
    compiled = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab), max_threads=1,
                                   cache_enabled=False).compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
    xb = xgr.allocate_token_bitmask(1, vocab)
    rows = {"xgrammar": (time.perf_counter() - t0, _walks(
        lambda: xgr.GrammarMatcher(compiled), lambda m: (m.fill_next_token_bitmask(xb, 0), xb[0])[1],
        lambda m, t: m.accept_token(t), lambda m: m.is_terminated(), vocab))}
    try:
        import llguidance
        import llguidance.hf
        import llguidance.torch as lt
    except ImportError:
        print("llguidance not installed: its row is skipped")
    else:
        t0 = time.perf_counter()
        lltok, grammar = llguidance.hf.from_tokenizer(tok, n_vocab=vocab), llguidance.LLMatcher.grammar_from_json_schema(SCHEMA)
        lb = lt.allocate_token_bitmask(1, vocab)
        rows["llguidance"] = (time.perf_counter() - t0, _walks(
            lambda: llguidance.LLMatcher(lltok, grammar), lambda m: (lt.fill_next_token_bitmask(m, lb, 0), lb[0])[1],
            lambda m, t: m.consume_token(t), lambda m: m.is_stopped(), vocab))
    for name, (setup, t) in rows.items():
        print(f"{name:11s} setup+compile {setup:5.2f} s  masks {len(t)}: mean {1e6 * sum(t) / len(t):6.0f} us  "
              f"median {1e6 * t[len(t) // 2]:5.0f} us  p99 {1e6 * t[int(0.99 * len(t))]:6.0f} us  max {1e3 * t[-1]:.1f} ms")


def cost(args) -> None:
    from runtime.config import EngineConfig
    from runtime.engine import Engine
    from runtime.guided import Guides, GuideSpec
    from runtime.sequence import SamplingParams

    engine = Engine(EngineConfig(model=args.model, max_model_len=1024, max_num_seqs=16))
    t0 = time.perf_counter()
    guides = Guides(engine.tokenizer, engine.runner.vocab_size, engine.eos_token_ids)
    t1 = time.perf_counter()
    guide = guides.compile(GuideSpec.json_schema(SCHEMA))
    print(f"grammar compiler {t1 - t0:.2f} s (once a server, built in the background at startup), first schema "
          f"{time.perf_counter() - t1:.3f} s")
    tok = engine.tokenizer
    ask = [f"Describe {p} as JSON with name, age, tags and city." for p in ("a teacher", "a pilot", "a chef", "a poet")]
    prompts = [tok(tok.apply_chat_template([{"role": "user", "content": a}], add_generation_prompt=True, tokenize=False),
                   add_special_tokens=False)["input_ids"] for a in ask * 4]
    for batch in (1, 16):
        best, tpot = {}, {}
        for r in range(args.rounds + 1):
            for name, extra in (("unconstrained", {"ignore_eos": True}), ("json-schema", {"guide": guide})):
                params = [SamplingParams(max_tokens=args.tokens, temperature=0.7, seed=i, **extra) for i in range(batch)]
                t0 = time.perf_counter()
                done = engine.generate(prompts[:batch], params)
                n = sum(o.completion_tokens for o in done)
                if r:
                    best[name] = max(best.get(name, 0.0), n / (time.perf_counter() - t0))
                    tpot.setdefault(name, []).append(_tpot(done))
        ratio = best["json-schema"] / best["unconstrained"]
        fast = {k: min(v) * 1e3 for k, v in tpot.items()}
        print(f"batch {batch:2d}: unconstrained {best['unconstrained']:6.1f} tok/s, json-schema {best['json-schema']:6.1f} "
              f"tok/s ({ratio:.2f}x); TPOT {fast['unconstrained']:.2f} against {fast['json-schema']:.2f} ms "
              f"({fast['json-schema'] / fast['unconstrained'] - 1:+.1%})")


def _tpot(done) -> float:
    """Median seconds a token after each request's first (the prompt's prefill and short outputs do not count)."""
    per = sorted((o.finish_time - o.first_token_time) / (o.completion_tokens - 1) for o in done
                 if o.first_token_time is not None and o.completion_tokens > 1)
    return per[len(per) // 2]


def main(argv: list[str] | None = None) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a file from anywhere: this tree's runtime
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("mask")
    c = sub.add_parser("cost")
    c.add_argument("--model", default="smollm2-135m")
    c.add_argument("--tokens", type=int, default=48)
    c.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    {"mask": mask, "cost": cost}[args.cmd](args)


if __name__ == "__main__":
    main()
