"""Quantization benchmark: every recipe side by side with the fp baseline and llm-compressor, in one run.

  .venv/bin/python scripts/bench/quant.py [--recipes rtn4,awq4,gptq4] [--llmc rtn,gptq,awq] [--tasks ...]
  .venv/bin/python scripts/bench/quant.py --model runs/smollm2-off-grid --runs runs/bench-off-grid --llmc ""

Rows already scored under ``--runs`` (its quant.json) are kept, not run again: a long run resumes where it stopped.

Same fp model (SmolLM2-135M, dequantized from the embedded GGUF), same 128 x 512 calibration tokens
(wiki calibration split, seed 0), same evaluation windows (first 64 non-overlapping 512-token windows
of the held-out wiki split and of LAMBADA's eval half). Writes runs/bench/quant.json and prints the
markdown table that goes into BENCHMARKS.md.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import window_ppl  # noqa: E402

RUNS = ROOT / "runs" / "bench"  # --runs replaces it (one folder per model: its fp copy, tokens and rows)


def eval_windows(tokenizer, source: str, seqlen: int, n: int) -> torch.Tensor:
    from compress.data import load_texts, tokenize

    ids = tokenize(tokenizer, "\n\n".join(load_texts(source, "eval")))
    windows = ids[: (ids.numel() // seqlen) * seqlen].reshape(-1, seqlen)
    return windows[:n]


def prepare(args, base: dict | None) -> tuple[Path, Path, dict]:
    """The fp copy and the token windows under ``--runs`` (made once), and the baseline's row (``base`` if scored)."""
    from compress.data import calibration_batches
    from compress.format.models import load_model

    fp_dir, tok_path = Path(args.runs) / "fp", Path(args.runs) / "tokens.pt"
    model, tok, _ = load_model(args.model)
    if not (fp_dir / "config.json").exists():
        model.save_pretrained(fp_dir)
        tok.save_pretrained(fp_dir)
    if not tok_path.exists():
        tokens = {"calib": calibration_batches(tok, "wiki", 128, 512, 0),
                  "eval": {s: eval_windows(tok, s, 512, args.windows) for s in ("wiki", "lambada")}}
        torch.save(tokens, tok_path)
    tokens = torch.load(tok_path)
    if base is not None:
        return fp_dir, tok_path, base
    base = {"recipe": "baseline (fp32)", "ppl": {k: window_ppl(model, w) for k, w in tokens["eval"].items()},
            "size_bytes": sum(p.numel() * p.element_size() for p in model.parameters())}
    if args.tasks:
        base["accuracy"] = tasks(model, tok, args)
    return fp_dir, tok_path, base


def tasks(model, tok, args) -> dict:
    from eval.tasks import run_tasks

    res = run_tasks(model, tok, args.tasks.split(","), limit=args.limit)
    return {t: m.get("acc_norm", m.get("acc", next(iter(m.values())))) for t, m in res.items()}  # acc_norm if defined


def ours(recipe: str, tokens: dict, args) -> dict:
    from compress.format.models import load_model

    out, js = Path(args.runs) / f"q-{recipe}", Path(args.runs) / f"q-{recipe}.json"
    cmd = [str(ROOT / ".venv/bin/compress"), "quantize", "--recipe", recipe, "--model", args.model, "--out", str(out),
           "--overwrite", "--json", str(js)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    summary = json.loads(js.read_text())
    model, tok, _ = load_model(str(out))
    for m in model.modules():
        if hasattr(m, "cache_weight"):
            m.cache_weight()
    row = {"recipe": recipe, "ppl": {k: window_ppl(model, w) for k, w in tokens["eval"].items()},
           "size_bytes": summary["out_bytes"], "seconds": summary["seconds"],
           "peak_rss_bytes": summary["peak_rss_bytes"]}
    fell = summary["report"].get("notes", {}).get("fallback")  # layers compress/methods/common/fallback.py kept at RTN
    if fell:
        row["fallback"] = f"{fell['rtn']} of {fell['judged']}"
    if args.tasks:
        row["accuracy"] = tasks(model, tok, args)
    return row


def llmc(method: str, fp_dir: Path, tok_path: Path, nsamples: int = 0) -> dict:
    js = fp_dir.parent / f"llmc-{method}.json"
    py = ROOT / ".venv-llmc/bin/python"
    subprocess.run([str(py), str(Path(__file__).parent / "llmc_quant.py"), "--model", str(fp_dir), "--tokens",
                    str(tok_path), "--method", method, "--nsamples", str(nsamples), "--json", str(js)], check=True,
                   stdout=subprocess.DEVNULL)
    r = json.loads(js.read_text())
    label = f"llm-compressor {method}" + (f" ({nsamples} calibration windows)" if nsamples else "")
    return {"recipe": label, "ppl": r["ppl"], "seconds": r["seconds"],
            "peak_rss_bytes": r["peak_rss_bytes"]}


def table(rows: list[dict], base: dict) -> str:
    rtn = next((r for r in rows if r["recipe"] == "rtn4"), None)
    head = ("| recipe | size MiB | wiki ppl | LAMBADA ppl | gap closed vs rtn4 (wiki / LAMBADA) | task acc: average "
            "(each) | quantize s | peak RSS MiB | layers kept at RTN |")
    lines = [head, "|" + "---|" * 9]
    for r in [base, *rows]:
        closed = ""
        if rtn and r is not base and r is not rtn:
            closed = " / ".join(f"{(rtn['ppl'][k] - r['ppl'][k]) / (rtn['ppl'][k] - base['ppl'][k]) * 100:.0f}%"
                                for k in ("wiki", "lambada"))
        acc = r.get("accuracy")
        acc_s = (f"{sum(acc.values()) / len(acc) * 100:.1f} (" + ", ".join(f"{k} {v * 100:.1f}" for k, v in acc.items())
                 + ")") if acc else ""
        size = f"{r['size_bytes'] / 2**20:.0f}" if r.get("size_bytes") else ""
        secs = f"{r['seconds']:.0f}" if r.get("seconds") else ""
        rss = f"{r['peak_rss_bytes'] / 2**20:.0f}" if r.get("peak_rss_bytes") else ""
        lines.append(f"| {r['recipe']} | {size} | {r['ppl']['wiki']:.2f} | {r['ppl']['lambada']:.2f} | {closed} | "
                     f"{acc_s} | {secs} | {rss} | {r.get('fallback', '')} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--recipes", default="rtn4,gptq4,awq4,awq-gptq4,nf4,int8")
    ap.add_argument("--llmc", default="rtn,gptq,awq", help="llm-compressor methods to run side by side ('' for none)")
    ap.add_argument("--llmc-awq-nsamples", type=int, default=8,
                    help="calibration windows for llm-compressor's AWQ: it forwards every window per grid point, "
                         "about 6 min a layer with 64 windows on 2 CPU cores (0: all 128)")
    ap.add_argument("--tasks", default="", help="e.g. hellaswag,piqa,arc_easy,winogrande")
    ap.add_argument("--limit", type=int, default=500)
    ap.add_argument("--windows", type=int, default=64)
    ap.add_argument("--runs", default=str(RUNS), help="folder for this model's fp copy, tokens, checkpoints, results")
    args = ap.parse_args()
    if args.llmc and not (ROOT / ".venv-llmc/bin/python").exists():  # before any work, not after our rows
        raise SystemExit("llm-compressor venv missing (or pass --llmc ''): python3 -m venv .venv-llmc && "
                         ".venv-llmc/bin/pip install torch==2.13.0 llmcompressor==0.14.0.1")
    path = Path(args.runs) / "quant.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    before = json.loads(path.read_text()) if path.exists() else {}
    fp_dir, tok_path, base = prepare(args, before.get("baseline"))
    tokens = torch.load(tok_path)
    done = {r["recipe"]: r for r in before.get("rows", [])}
    rows = []

    def save() -> None:  # after every row, so a stopped run keeps what it scored
        result = {"date": time.strftime("%Y-%m-%d"), "seconds": time.time() - t0, "cpu": cpu_model(),
                  "baseline": base, "rows": rows}
        path.write_text(json.dumps(result, indent=2))
    for r in [r for r in args.recipes.split(",") if r]:
        rows.append(done.get(r) or ours(r, tokens, args))
        save()
    for m in [m for m in args.llmc.split(",") if m]:
        rows.append(llmc(m, fp_dir, tok_path, args.llmc_awq_nsamples if m == "awq" else 0))
        save()
    print(table(rows, base))


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


if __name__ == "__main__":
    main()
