"""SmolLM2 off its grid: a copy of a model whose decoder linears get seeded Gaussian noise of ``--sigma`` times each
group's 4-bit quantization step, saved as an HF folder (issue 34).

SmolLM2-135M's embedded weights are a dequantized Q4_1 file: every block of 32 weights already sits on a 4-bit grid,
which flatters calibrated methods. The noise moves each weight off that grid, as bf16 weights of a model trained in
floating point would be, while keeping most of the model's function. The default, half a step, is the least that
leaves no trace of the grid: a sum of Gaussians one step apart with std ``sigma`` ripples by ``2 exp(-2 pi^2
sigma^2)`` of its mean, 58% at a quarter step (still clumped on the grid) and 1.4% at half a step (flat).

  .venv/bin/python scripts/off_grid.py --out runs/smollm2-off-grid [--model smollm2-135m] [--sigma 0.5] [--group 32]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


def perturb(w, sigma: float, group: int, gen):
    """``w: [out, in]`` plus N(0, (sigma * step)^2) noise, ``step`` each (row, group of ``group`` inputs)'s
    (max - min) / 15."""
    import torch

    out_f, in_f = w.shape
    g = group if in_f % group == 0 else in_f
    wg = w.float().reshape(out_f, in_f // g, g)  # [out, in] -> [out, n_groups, g]
    step = (wg.amax(-1, keepdim=True) - wg.amin(-1, keepdim=True)) / 15
    noise = torch.randn(wg.shape, generator=gen) * step * sigma
    return (wg + noise).reshape(out_f, in_f).to(w.dtype)


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import torch
    from torch import nn

    from compress.calibrate import decoder_layers
    from compress.format.models import load_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--out", required=True)
    ap.add_argument("--sigma", type=float, default=0.5, help="noise std in grid steps")
    ap.add_argument("--group", type=int, default=32, help="inputs per grid step (Q4_1: 32)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    model, tok, _ = load_model(args.model)
    gen = torch.Generator().manual_seed(args.seed)
    n = 0
    with torch.no_grad():
        for block in decoder_layers(model):
            for _, m in sorted(block.named_modules(), key=lambda kv: kv[0]):
                if isinstance(m, nn.Linear):
                    m.weight.copy_(perturb(m.weight, args.sigma, args.group, gen))
                    n += 1
    model.save_pretrained(args.out)
    tok.save_pretrained(args.out)
    print(f"{n} linears perturbed by {args.sigma} of a {args.group}-input group's 4-bit step -> {args.out}")


if __name__ == "__main__":
    main()
