"""Our GGUF exports against llama.cpp's own quantizer on SmolLM2, side by side in one run (issue 13).

For each recipe (quantized once with `compress quantize`, reused when its folder exists) the script exports
`--format gguf --embed-type q8_0`, then measures, on the same held-out text:
- `compress` perplexity of the checkpoint itself, under llama-perplexity's protocol (windows of --ctx
  tokens, only the second half of each window scored, no BOS: SmolLM2 adds none), and `llama-perplexity`
  of the exported file: the two should agree within 0.5%;
- `llama-quantize` of the same fp model (an F32 GGUF we export from the embedded SmolLM2) to Q4_0 and Q4_1
  (token embedding Q8_0, as ours), and with `--imatrix` to Q4_K_M, through the same llama-perplexity;
- the --k-quants export (Q4_K with our codes) of the --k-quants recipes, beside llama-quantize's Q4_K_M;
- export time, file sizes, and, with --speed, `llama-bench` of ours against llama-quantize's file of each type;
- with --greedy, the first 32 greedy tokens of llama.cpp's `llama-simple` against `compress generate`.
Note: SmolLM2's shipped weights are themselves Q4_1, so at Q4_1 any method re-finds the original grid.

  bash scripts/bench/llamacpp.sh          # once: builds llama-perplexity, llama-quantize, ... (minutes)
  .venv/bin/python scripts/bench/gguf_vs_llamacpp.py [--recipes gptq4-q4_0,awq4-q4_1,qat4] [--k-quants awq4-q4_1]
      [--chunks 64] [--ctx 512] [--threads T] [--speed] [--greedy] [--work out/gguf-bench] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LLAMA_TYPES = ("Q4_0", "Q4_1")
PROMPTS = ("The capital of France is", "Once upon a time, there was a", "def fibonacci(n):")


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    print("+", " ".join(map(str, cmd)), file=sys.stderr, flush=True)
    return subprocess.run([str(c) for c in cmd], check=True, text=True, capture_output=True, **kw)


def compress(*args: str) -> subprocess.CompletedProcess:
    return run([ROOT / ".venv/bin/compress", *args], cwd=ROOT)


def llamacpp_bin(given: str | None) -> Path:
    if given:
        return Path(given)
    out = subprocess.run(["bash", str(ROOT / "scripts/bench/llamacpp.sh")], check=True, text=True, capture_output=True)
    return Path(out.stdout.strip().splitlines()[-1])


def held_out_text(path: Path, source: str) -> Path:
    """The eval split compress eval scores, joined as it joins it, written once for llama-perplexity."""
    if not path.is_file():
        sys.path.insert(0, str(ROOT))
        from compress.data import load_texts

        path.write_text("\n\n".join(load_texts(source, "eval")))
    return path


def llama_ppl(bin_dir: Path, gguf: Path, text: Path, ctx: int, chunks: int, threads: int, tries: int = 3) -> float:
    """llama-perplexity's final estimate. Its log thread can exit before writing the last lines (status 0): the
    running estimate printed after the last chunk is the same number; a run cut before that is repeated."""
    for _ in range(tries):
        out = run([bin_dir / "llama-perplexity", "-m", gguf, "-f", text, "-c", ctx, "--chunks", chunks, "-t", threads,
                   "-b", ctx])
        log = out.stdout + out.stderr
        found = re.search(r"Final estimate: PPL = ([0-9.]+)", log)
        n = re.search(r"perplexity over (\d+) chunks", log)
        found = found or (n and re.search(rf"\[{n.group(1)}\]([0-9.]+)", log))
        if found:
            return float(found.group(1))
    raise RuntimeError(f"llama-perplexity printed no final estimate for {gguf} in {tries} runs")


def second_half_ppl(model_dir: Path, text: Path, ctx: int, chunks: int) -> float:
    """Perplexity by llama-perplexity's rule: non-overlapping windows of ``ctx`` tokens, the second half scored."""
    import torch

    sys.path.insert(0, str(ROOT))
    from compress.data import tokenize
    from compress.format.models import load_model

    model, tokenizer, _ = load_model(str(model_dir))
    ids = tokenize(tokenizer, text.read_text())
    n = min(chunks, ids.numel() // ctx)
    windows = ids[: n * ctx].view(n, ctx)  # [n, ctx]
    first = ctx // 2  # llama-perplexity: logits at positions first..ctx-2 score tokens first+1..ctx-1
    nll, count = 0.0, 0
    with torch.inference_mode():
        for batch in windows.split(4):
            logits = model(input_ids=batch).logits[:, first:-1].float()
            target = batch[:, first + 1:]
            nll += torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1),
                                                     reduction="sum").item()
            count += target.numel()
    return math.exp(nll / count)


def ours(recipe: str, work: Path, k_quants: bool = False) -> tuple[Path, Path, float]:
    """(checkpoint folder, exported GGUF, export seconds) for one recipe."""
    folder = work / f"smollm2-135m-{recipe}"
    if not (folder / "config.json").is_file():
        compress("quantize", "--recipe", recipe, "--out", str(folder), "--overwrite")
    gguf = work / f"{recipe}{'-k' if k_quants else ''}.gguf"
    t0 = time.perf_counter()
    compress("export", str(folder), "--format", "gguf", "--out", str(gguf), "--embed-type", "q8_0", "--overwrite",
             *(["--k-quants"] if k_quants else []))
    return folder, gguf, time.perf_counter() - t0


def theirs(bin_dir: Path, work: Path, calib: Path, threads: int) -> dict[str, Path]:
    """llama-quantize of the fp model to each type, plus Q4_K_M with an importance matrix."""
    fp = work / "smollm2-135m-f32.gguf"
    if not fp.is_file():
        compress("export", "smollm2-135m", "--format", "gguf", "--out", str(fp), "--embed-type", "f32")
    out = {}
    for t in LLAMA_TYPES:
        out[t] = work / f"llama-quantize-{t}.gguf"
        run([bin_dir / "llama-quantize", "--token-embedding-type", "q8_0", fp, out[t], t, threads])
    imatrix = work / "imatrix.dat"
    if not imatrix.is_file():
        run([bin_dir / "llama-imatrix", "-m", fp, "-f", calib, "-o", imatrix, "-c", 512, "--chunks", 64, "-t", threads])
    out["Q4_K_M-imatrix"] = work / "llama-quantize-Q4_K_M-imatrix.gguf"
    run([bin_dir / "llama-quantize", "--imatrix", imatrix, fp, out["Q4_K_M-imatrix"], "Q4_K_M", threads])
    out["F32"] = fp
    return out


def greedy(bin_dir: Path, gguf: Path, folder: Path) -> list[bool] | None:
    """Whether llama.cpp's greedy 32 tokens equal compress generate's, per prompt (None: no llama-simple)."""
    simple = bin_dir / "llama-simple"
    if not simple.is_file():
        print(f"skip greedy parity: {simple} is not built (add it to llamacpp.sh's targets)", file=sys.stderr)
        return None
    same = []
    for p in PROMPTS:
        theirs_text = run([simple, "-m", gguf, "-n", 32, p]).stdout
        ours_text = compress("generate", str(folder), "--prompt", p, "--max-new-tokens", "32").stdout.strip()
        same.append(ours_text in theirs_text)
    return same


def main_type(path: Path) -> str:
    """The file's general.file_type as llama.cpp's type name (2: Q4_0, 3: Q4_1, 7: Q8_0)."""
    import gguf

    ftype = int(gguf.GGUFReader(path).fields["general.file_type"].contents())
    return {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0"}.get(ftype, str(ftype))


def speed(bin_dir: Path, a: Path, b: Path, threads: int) -> dict[str, float]:
    out = json.loads(run([bin_dir / "llama-bench", "-m", a, "-m", b, "-p", 128, "-n", 32, "-t", threads,
                          "-o", "json"]).stdout)
    return {f"{Path(r['model_filename']).name} {'pp' if r['n_prompt'] else 'tg'}": r["avg_ts"] for r in out}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipes", default="gptq4-q4_0,awq4-q4_1,qat4", help="comma-separated compress recipes")
    ap.add_argument("--k-quants", default="awq4-q4_1", help="recipes also exported with --k-quants (Q4_K rows)")
    ap.add_argument("--text", default="wiki", help="held-out text source (compress.data), eval split")
    ap.add_argument("--calib", default="wiki", help="text for llama-imatrix (calib split)")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--chunks", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--llamacpp-bin", default=None, help="folder of llama.cpp tools; default: scripts/bench/llamacpp.sh")
    ap.add_argument("--work", default=str(ROOT / "out/gguf-bench"))
    ap.add_argument("--speed", action="store_true", help="also llama-bench ours against llama-quantize's")
    ap.add_argument("--greedy", action="store_true", help="also greedy parity (needs llama-simple)")
    ap.add_argument("--json", default=None)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    bin_dir = llamacpp_bin(a.llamacpp_bin)
    text = held_out_text(work / f"{a.text}-eval.txt", a.text)
    calib = work / f"{a.calib}-calib.txt"
    if not calib.is_file():
        sys.path.insert(0, str(ROOT))
        from compress.data import load_texts

        calib.write_text("\n\n".join(load_texts(a.calib, "calib")))
    rows = []
    for name, path in theirs(bin_dir, work, calib, a.threads).items():
        rows.append({"model": f"llama-quantize {name}", "llama_ppl": llama_ppl(bin_dir, path, text, a.ctx, a.chunks,
                                                                                 a.threads),
                     "bytes": path.stat().st_size})
    runs = [(r, False) for r in a.recipes.split(",")] + [(r, True) for r in a.k_quants.split(",") if r]
    for recipe, k_quants in runs:
        folder, gguf, seconds = ours(recipe, work, k_quants)
        row = {"model": f"compress {recipe}{' --k-quants' if k_quants else ''}", "llama_ppl": llama_ppl(bin_dir, gguf, text, a.ctx, a.chunks, a.threads),
               "compress_ppl": second_half_ppl(folder, text, a.ctx, a.chunks), "bytes": gguf.stat().st_size,
               "export_s": seconds}
        row["ppl_gap_pct"] = 100 * (row["llama_ppl"] / row["compress_ppl"] - 1)
        if a.greedy:
            row["greedy_same"] = greedy(bin_dir, gguf, folder)
        if a.speed and (t := main_type(gguf)) in LLAMA_TYPES:  # the same kernels: llama-quantize's file of our type
            row["speed"] = speed(bin_dir, gguf, work / f"llama-quantize-{t}.gguf", a.threads)
        rows.append(row)
    fp = next(r["llama_ppl"] for r in rows if r["model"] == "llama-quantize F32")
    print(f"{'model':34s} {'llama-ppl':>10s} {'vs fp':>8s} {'compress':>9s} {'gap':>7s} {'MiB':>7s} {'export':>7s}")
    for r in rows:
        cp = f"{r['compress_ppl']:.3f}" if "compress_ppl" in r else "-"
        gap = f"{r['ppl_gap_pct']:+.2f}%" if "ppl_gap_pct" in r else "-"
        ex = f"{r['export_s']:.1f}s" if "export_s" in r else "-"
        print(f"{r['model']:34s} {r['llama_ppl']:10.3f} {100 * (r['llama_ppl'] / fp - 1):+7.2f}% {cp:>9s} {gap:>7s} "
              f"{r['bytes'] / 2**20:7.1f} {ex:>7s}")
    if a.json:
        Path(a.json).write_text(json.dumps({"settings": vars(a), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
