"""KV blocks that ``n`` choices of one request hold (issue 35): the peak of the engine's used blocks while ``n``
sampled choices of one prompt decode, against ``n=1``; the choices share the prompt's blocks.

  .venv/bin/python scripts/bench/n_choices.py --model out/smollm2-135m-awq4 [--n 4] [--prompt 512] [--tokens 64]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


def peak_blocks(model: str, ids: list[int], n: int, tokens: int) -> int:
    from runtime.config import EngineConfig
    from runtime.engine import Engine
    from runtime.sequence import SamplingParams

    engine = Engine(EngineConfig(model=model, max_model_len=len(ids) + tokens + 16, block_size=16))
    engine.add_choices(ids, [SamplingParams(temperature=0.8, max_tokens=tokens, ignore_eos=True, seed=i)
                             for i in range(n)], [f"c{i}" for i in range(n)])
    peak = 0
    while engine.has_unfinished():
        engine.step()
        peak = max(peak, engine.block_manager.num_used_blocks)
    return peak


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=512, help="prompt tokens, from the held-out wiki text")
    ap.add_argument("--tokens", type=int, default=64, help="new tokens per choice")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from compress.data import load_texts, tokenize
    from compress.format.models import load_tokenizer, resolve

    tok = load_tokenizer(resolve(args.model))
    ids = tokenize(tok, "\n\n".join(load_texts("wiki", "eval")))[:args.prompt].tolist()
    one, many = peak_blocks(args.model, ids, 1, args.tokens), peak_blocks(args.model, ids, args.n, args.tokens)
    print(f"{args.prompt}-token prompt + {args.tokens} tokens, blocks of 16: n=1 peak {one} blocks, "
          f"n={args.n} peak {many} ({many / one:.2f}x)")


if __name__ == "__main__":
    main()
