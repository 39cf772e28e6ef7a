"""QAT vs PTQ and GQA/MQA conversion on SmolLM2-135M: perplexity on held-out wiki and LAMBADA text.

Runs (each writes runs/qat_gqa/NAME/; an existing folder is reused unless --overwrite):
  rtn4, awq4          PTQ baselines (recipes/rtn4.yaml, recipes/awq4.yaml)
  qat4                recipes/qat4.yaml: AWQ init, distillation fine-tuning (--qat-steps overrides steps)
  qat4-rtn            the same from an RTN init
  qat4-learnzero      (not in the default set) learned integer zeros with an STE
  mqa                 3 -> 1 KV heads by mean pooling, fp, no uptraining
  mqa-uptrain         the same plus --uptrain-steps of distillation (at --uptrain-lr)
  mqa-pca             3 -> 1 KV heads by activation-aware, RoPE-compatible merging (compress/transforms/gqa_pca.py)
  mqa-pca-uptrain     the same plus --uptrain-steps of distillation (at --uptrain-lr)
  mqa-pca-fit         mqa-pca plus --fit-steps per layer fitting each attention to the original's outputs
  mqa-pca-fit-uptrain the same plus --uptrain-steps of distillation (recipes/mqa-awq4.yaml's GQA part)
Then every folder and the fp model are scored on the eval splits (disjoint from calibration) with
eval.report.evaluate_model, and a table prints: ppl per text, the share of RTN's gap to fp that each
method closes, training seconds, and KV-cache bytes per token.

  .venv/bin/python scripts/bench_qat_gqa.py [--runs rtn4,awq4,qat4,qat4-rtn,mqa,mqa-uptrain]
      [--qat-steps N] [--uptrain-steps N] [--uptrain-lr 5e-5] [--uptrain-scope blocks|attn]
      [--fit-steps 300] [--fit-lr 1e-3]
      [--max-windows 128] [--out runs/qat_gqa] [--overwrite]
"""
from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

MODEL = "smollm2-135m"
DEFAULT_RUNS = "rtn4,awq4,qat4,qat4-rtn,mqa,mqa-uptrain"
QUANT_RUNS = {"rtn4": ("rtn4", {}), "awq4": ("awq4", {}), "qat4": ("qat4", {}), "qat4-rtn": ("qat4", {"init": "rtn"}),
              "qat4-learnzero": ("qat4", {"learn_zero": True})}
# name -> (uptraining steps (None: --uptrain-steps), KV-head init, layer-wise fitting (--fit-steps) or not)
GQA_RUNS = {"mqa": (0, "mean", False), "mqa-uptrain": (None, "mean", False), "mqa-pca": (0, "pca", False),
            "mqa-pca-uptrain": (None, "pca", False), "mqa-pca-fit": (0, "pca", True),
            "mqa-pca-fit-uptrain": (None, "pca", True)}


def _train_bar(name: str):
    from tqdm import tqdm

    bar = tqdm(desc=f"{name} train", unit="step")

    def progress(step: int, steps: int, loss: float) -> None:
        bar.total = steps
        bar.set_postfix(kl=f"{loss:.4f}")
        bar.update(step - bar.n)
    return progress


def run_quant(name: str, out: Path, qat_steps: int | None, overwrite: bool) -> dict:
    from compress.config import load_recipe
    from compress.job import quantize_to_folder

    recipe, changes = QUANT_RUNS[name]
    cfg = load_recipe(recipe).replace(**changes, steps=qat_steps if recipe == "qat4" else None)
    res = quantize_to_folder(MODEL, cfg, str(out), overwrite=overwrite, recipe=recipe, train_progress=_train_bar(name))
    return {"seconds": res.seconds, "out_bytes": res.out_bytes, **res.report.notes.to_json()}


def run_gqa(name: str, out: Path, uptrain_steps: int, lr: float, init: str, scope: str, fit_steps: int,
            fit_lr: float, overwrite: bool) -> dict:
    from compress.transforms import gqa

    def fit_progress(layer: int, layers: int, before: float, after: float) -> None:
        print(f"{name} fit layer {layer}/{layers}: relative error {before:.4f} -> {after:.4f}", flush=True)

    t0 = time.perf_counter()
    rep = gqa.convert_to_folder(MODEL, 1, str(out), uptrain_steps=uptrain_steps, lr=lr, overwrite=overwrite,
                                progress=_train_bar(name), init=init, scope=scope, fit_steps=fit_steps,
                                fit_lr=fit_lr, fit_progress=fit_progress)
    info = {"seconds": time.perf_counter() - t0, "init": init, "uptrain_lr": lr, "uptrain_scope": scope,
            "kv_heads": [rep.kv.kv_heads_before, rep.kv.kv_heads_after],
            "kv_bytes_per_token": [rep.kv.kv_bytes_per_token_before, rep.kv.kv_bytes_per_token_after]}
    if rep.fit is not None:
        info.update(fit_steps=fit_steps, fit_lr=fit_lr, fit_seconds=rep.fit.seconds,
                    fit_error=[rep.fit.mean_before, rep.fit.mean_after])
    if rep.uptrain is not None:
        info.update(uptrain_steps=len(rep.uptrain.losses), uptrain_seconds=rep.uptrain.seconds,
                    uptrain_kl=[rep.uptrain.first, rep.uptrain.last])
    return info


def summarize(results: dict) -> str:
    fp = results["fp"]["ppl"]
    rtn = results.get("rtn4", {}).get("ppl")
    header = " ".join(f"{'ppl ' + t:>12s}" for t in fp)
    lines = [f"{'model':16s} {header}  gap closed vs rtn4   train s   KV B/tok"]
    for name, r in results.items():
        if "ppl" not in r:
            continue
        closed = ""
        if rtn and name not in ("fp", "rtn4") and not name.startswith("mqa"):
            closed = " ".join(f"{(rtn[t] - r['ppl'][t]) / (rtn[t] - fp[t]):7.0%}" if rtn[t] != fp[t] else "    -"
                              for t in fp)
        train = r.get("qat", {}).get("train_seconds") or (r.get("uptrain_seconds", 0) + r.get("fit_seconds", 0))
        kv = r.get("kv_bytes_per_token", results["fp"].get("kv_bytes_per_token"))
        kv = kv[1] if isinstance(kv, list) else kv  # a GQA run records [before, after]
        lines.append(f"{name:16s} " + " ".join(f"{r['ppl'][t]:12.3f}" for t in fp) + f"  {closed:18s}"
                     + f" {train or 0:8.0f}   {kv or '-'}")
    for name in GQA_RUNS:
        if name in results and "ppl" in results[name]:
            rel = {t: results[name]["ppl"][t] / fp[t] - 1 for t in fp}
            lines.append(f"{name}: ppl vs fp " + ", ".join(f"{t} {v:+.1%}" for t, v in rel.items()))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", default=DEFAULT_RUNS)
    ap.add_argument("--qat-steps", type=int, default=None, help="override recipes/qat4.yaml's steps")
    ap.add_argument("--uptrain-steps", type=int, default=200)
    ap.add_argument("--uptrain-lr", type=float, default=5e-5)
    ap.add_argument("--uptrain-scope", default="blocks", help="train decoder blocks, or attn(ention) only")
    ap.add_argument("--fit-steps", type=int, default=300, help="layer-wise fitting steps per layer (*-fit runs)")
    ap.add_argument("--fit-lr", type=float, default=1e-3)
    ap.add_argument("--max-windows", type=int, default=128, help="512-token windows scored per text")
    ap.add_argument("--ppl", default="wiki,lambada")
    ap.add_argument("--out", default="runs/qat_gqa")
    ap.add_argument("--overwrite", action="store_true")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    from compress.data import load_texts
    from compress.format.models import load_model
    from compress.transforms import gqa
    from eval.report import evaluate_model

    runs = [r.strip() for r in args.runs.split(",") if r.strip()]
    unknown = [r for r in runs if r not in QUANT_RUNS and r not in GQA_RUNS]
    if unknown:
        raise SystemExit(f"unknown run(s) {unknown}; choose from {list(QUANT_RUNS) + list(GQA_RUNS)}")
    root = Path(args.out)
    root.mkdir(parents=True, exist_ok=True)
    results_path = root / "results.json"
    results = json.loads(results_path.read_text()) if results_path.exists() and not args.overwrite else {}
    fp_model, _, _ = load_model(MODEL)
    results.setdefault("fp", {})["kv_bytes_per_token"] = gqa.kv_cache_bytes_per_token(fp_model.config)
    del fp_model
    for name in runs:
        out = root / name
        if out.exists() and not args.overwrite:
            print(f"{name}: reusing {out}")
            results.setdefault(name, {})
            continue
        print(f"{name}: building {out}", flush=True)
        if name in QUANT_RUNS:
            results[name] = run_quant(name, out, args.qat_steps, args.overwrite)
        else:
            steps, init, fit = GQA_RUNS[name]
            results[name] = run_gqa(name, out, args.uptrain_steps if steps is None else steps, args.uptrain_lr, init,
                                    args.uptrain_scope, args.fit_steps if fit else 0, args.fit_lr, args.overwrite)
        results_path.write_text(json.dumps(results, indent=2))
    texts = {s: load_texts(s, "eval") for s in args.ppl.split(",")}
    for name in ["fp", *runs]:
        if "ppl" in results.get(name, {}) and not args.overwrite:
            continue
        spec = MODEL if name == "fp" else str(root / name)
        ev = evaluate_model(spec, texts, [], None, 512, args.max_windows)
        results[name].update(ppl=ev.ppl, eval_seconds=ev.seconds)
        results_path.write_text(json.dumps(results, indent=2))
        print(f"{name}: " + ", ".join(f"ppl {t} {v:.3f}" for t, v in ev.ppl.items()), flush=True)
    print(summarize(results))
    print(f"wrote {results_path}")


if __name__ == "__main__":
    main()
