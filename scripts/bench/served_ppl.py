"""What is served is what was evaluated: held-out perplexity of one checkpoint through `compress eval`'s loader
(transformers with QuantLinear) and through the serving engine's own forward (paged KV cache, packed kernels,
fused CPU kernels, each LM head variant), on the same windows.

  .venv/bin/python scripts/bench/served_ppl.py out/smollm2-135m-awq4 [--ppl wiki] [--max-windows 16]
      [--heads fp,int8,int4] [--modes decode] [--json PATH]

``decode`` feeds every window token by token (the decode kernels a served request runs); ``prefill`` scores
each window in one forward (the prompt path).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--ppl", default="wiki", help="text source (compress eval's --ppl), eval split")
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--max-windows", type=int, default=16)
    ap.add_argument("--heads", default="fp,int8,int4", help="engine LM heads to score")
    ap.add_argument("--modes", default="decode", help="decode and/or prefill")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--native-step", default="on", help="the native decode step: on, off, or on,off (both rows)")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from compress.data import load_texts
    from compress.format.checkpoint import quantized_modules
    from compress.format.models import load_model
    from eval.perplexity import perplexity
    from runtime.lm import EngineLM

    texts = load_texts(a.ppl, "eval")
    model, tok, _ = load_model(a.model)
    for m in quantized_modules(model).values():
        m.cache_weight()
    tick = time.perf_counter()
    ref = perplexity(model, tok, texts, seqlen=a.seqlen, max_windows=a.max_windows).ppl
    rows = [{"path": "compress eval (transformers + QuantLinear, fp32)", "ppl": ref, "seconds": time.perf_counter() - tick}]
    del model
    for mode, head, native in ((m, h, n) for m in a.modes.split(",") for h in a.heads.split(",")
                               for n in a.native_step.split(",")):
        lm = EngineLM(a.model, dtype=a.dtype, lm_head=head, mode=mode, max_len=a.seqlen, native_step=native == "on")
        tick = time.perf_counter()
        ppl = perplexity(lm, tok, texts, seqlen=a.seqlen, max_windows=a.max_windows, batch_size=4).ppl
        step = "native step" if lm.runner.model.native_step is not None else "per-op step"
        rows.append({"path": f"engine {mode}, {lm.dtype}, lm_head {lm.lm_head}, ops {lm.runner.ops.name}, {step}",
                     "ppl": ppl, "seconds": time.perf_counter() - tick})
    print(f"{a.model}: {a.ppl} eval split, {a.max_windows} windows of {a.seqlen} tokens")
    print("| path | ppl | vs compress eval | seconds |\n|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['path']} | {r['ppl']:.3f} | {100 * (r['ppl'] / ref - 1):+.2f}% | {r['seconds']:.0f} |")
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
