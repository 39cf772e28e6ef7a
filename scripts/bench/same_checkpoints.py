"""Did a change alter what quantization writes? Two checkpoint folders of the same recipe, tensor by tensor,
and both scored on the quantization benchmark's saved windows (runs/bench/tokens.pt, scripts/bench/quant.py).

  git worktree add /tmp/before <commit>
  PYTHONPATH=/tmp/before .venv/bin/python -c "import cli; cli.main()" quantize --recipe R --model smollm2-135m \\
      --out /tmp/before-R
  .venv/bin/compress quantize --recipe R --model smollm2-135m --out runs/bench/q-R
  .venv/bin/python scripts/bench/same_checkpoints.py /tmp/before-R runs/bench/q-R [more pairs ...]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import window_ppl  # noqa: E402


def tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def scores(folder: Path, windows: dict[str, torch.Tensor]) -> dict[str, float]:
    from compress.format.models import load_model

    model, _, _ = load_model(str(folder))
    for m in model.modules():
        if hasattr(m, "cache_weight"):
            m.cache_weight()
    return {k: window_ppl(model, w) for k, w in windows.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("folders", nargs="+", type=Path, help="before/after pairs")
    ap.add_argument("--tokens", type=Path, default=ROOT / "runs" / "bench" / "tokens.pt")
    args = ap.parse_args()
    if len(args.folders) % 2:
        raise SystemExit("give the folders in before/after pairs")
    windows = torch.load(args.tokens)["eval"]
    print("| before | after | tensors identical | ppl before | ppl after |")
    print("|---|---|---|---|---|")
    for before, after in zip(args.folders[::2], args.folders[1::2]):
        a, b = tensors(before), tensors(after)
        same = sum(k in b and torch.equal(a[k], b[k]) for k in a)
        pa, pb = scores(before, windows), scores(after, windows)
        fmt = lambda p: " / ".join(f"{k} {v:.3f}" for k, v in p.items())  # noqa: E731
        print(f"| {before} | {after} | {same}/{len(a)} (of {len(b)}) | {fmt(pa)} | {fmt(pb)} |", flush=True)


if __name__ == "__main__":
    main()
