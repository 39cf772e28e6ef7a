"""Perplexity and KL to a reference of several variants on the same windows, in lockstep: the reference's logits of a
batch are computed once and compared with every variant's (``compress report`` runs the reference again for each).
Variants that differ from one checkpoint only in their LM head (``--heads``) share that checkpoint's backbone pass:
their logits are each head applied to its final hidden states, which the script first checks equals the full model.

Issue 32's head measurements on SmolLM2's untied copy (scripts/bench/untie.py), wiki and LAMBADA in two processes:

    OMP_NUM_THREADS=1 python scripts/bench/head_kl.py --reference out/smollm2-untied --body out/smol-u-none \\
        --heads out/smol-u-h8-rtn,out/smol-u-h8-gptq,out/smol-u-h4-rtn,out/smol-u-h4-gptq \\
        --variants out/smol-u-e8 --ppl wiki --max-windows 64 --json out/head_kl-wiki.json
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
from torch import Tensor, nn


def _load(spec: str) -> nn.Module:
    from compress.format.checkpoint import quantized_modules
    from compress.format.models import load_model

    model = load_model(spec)[0]
    for m in quantized_modules(model).values():
        m.cache_weight()  # dequantize once, as eval does
    return model


def _outside_head(folder: str) -> dict[str, Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        out.update({k: v for k, v in load_file(str(f)).items() if not k.startswith("lm_head.")})
    return out


def check_same_body(body: str, heads: list[str]) -> None:
    """Every ``heads`` checkpoint holds the very tensors of ``body`` outside ``lm_head``."""
    want = _outside_head(body)
    for h in heads:
        got = _outside_head(h)
        diff = sorted(k for k in want.keys() | got.keys() if k not in got or k not in want or not torch.equal(got[k], want[k]))
        if diff:
            raise ValueError(f"{h} differs from {body} outside lm_head: {diff[:5]}")


def size_mib(folder: str) -> float:
    return sum(f.stat().st_size for f in Path(folder).glob("*.safetensors")) / 2**20


class Scores:
    """Summed NLL and every position's KL(reference || variant) of one variant."""

    def __init__(self):
        self.nll, self.tokens, self.kl = 0.0, 0, []

    def add(self, logits: Tensor, batch: Tensor, ref: Tensor) -> None:
        from eval.perplexity import window_nll_sum
        from eval.tradeoff.kl import token_kl

        self.nll += window_nll_sum(logits, batch).item()
        self.tokens += batch[:, 1:].numel()
        self.kl.append(token_kl(ref[:, :-1], logits[:, :-1]))

    def result(self) -> dict:
        from eval.tradeoff.kl import summarize

        kl = summarize(torch.cat(self.kl))
        return {"ppl": math.exp(self.nll / self.tokens), "kl_mean": kl.mean, "kl_p99": kl.p99, "tokens": self.tokens}


@torch.inference_mode()
def run(reference: str, body: str | None, heads: list[str], variants: list[str], text: str, seqlen: int,
        max_windows: int, batch_size: int, partial=None) -> dict:
    """Every row's ppl, KL and size; ``partial(result)`` sees the figures so far after each batch (the first windows
    of the same sequence for every row), so that a run cut short still reports what it measured."""
    from compress.calibrate import backbone
    from compress.data import load_texts
    from compress.format.models import load_tokenizer, resolve
    from eval.perplexity import token_windows

    if body and heads:
        check_same_body(body, heads)
    windows = token_windows(load_tokenizer(resolve(reference)), load_texts(text, "eval"), seqlen, max_windows)
    ref = _load(reference)
    full = {v: _load(v) for v in ([body] if body else []) + variants}
    head_mods = {h: _load(h).get_output_embeddings() for h in heads}
    scores = {k: Scores() for k in [*full, *head_mods]}
    t0 = time.perf_counter()
    for i, batch in enumerate(windows.split(batch_size)):
        want = ref(input_ids=batch).logits
        for name, model in full.items():
            if name == body and heads:
                hidden = backbone(model)(input_ids=batch, use_cache=False)[0]  # [b, t, hidden]
                logits = model.get_output_embeddings()(hidden)
                if i == 0:  # the head alone is the whole model's logits (no scaling or capping after it)
                    torch.testing.assert_close(logits, model(input_ids=batch).logits, rtol=1e-4, atol=1e-4)
                for h, mod in head_mods.items():
                    scores[h].add(mod(hidden), batch, want)
            else:
                logits = model(input_ids=batch).logits
            scores[name].add(logits, batch, want)
        print(f"{text}: batch {i + 1}/{-(-windows.shape[0] // batch_size)} ({time.perf_counter() - t0:.0f} s)",
              flush=True)
        done = min((i + 1) * batch_size, windows.shape[0])
        res = {"text": text, "windows": done, "seqlen": seqlen, "seconds": time.perf_counter() - t0,
               "threads": torch.get_num_threads(),
               "rows": {k: {**s.result(), "size_mib": size_mib(k) if Path(k).is_dir() else None}
                        for k, s in scores.items()}}
        if partial:
            partial(res)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reference", required=True)
    ap.add_argument("--body", default=None, help="the checkpoint whose backbone the --heads share")
    ap.add_argument("--heads", default="", help="comma-separated checkpoints differing from --body only in lm_head")
    ap.add_argument("--variants", default="", help="comma-separated checkpoints scored by their own full forward")
    ap.add_argument("--ppl", default="wiki")
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--max-windows", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    split = lambda s: [x for x in s.split(",") if x]  # noqa: E731
    def partial(res: dict) -> None:
        if args.json:
            Path(args.json).write_text(json.dumps(res, indent=1))

    res = run(args.reference, args.body, split(args.heads), split(args.variants), args.ppl, args.seqlen,
              args.max_windows, args.batch_size, partial)
    for k, r in res["rows"].items():
        size = "-" if r["size_mib"] is None else f"{r['size_mib']:.1f}"
        print(f"{k}\t{size} MiB\tppl {r['ppl']:.3f}\tKL {r['kl_mean']:.4f} (p99 {r['kl_p99']:.3f})")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
