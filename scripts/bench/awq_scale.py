"""AWQ's scale search for a linear group (compress/methods/awq.py ``search_scale`` with ``linear_error``: through the inputs'
Gram matrix where the input is narrower than the sample) against the same search scored on the group's outputs
``x @ w.T``, at awq4's settings (4,096 sampled rows, 20 grid points, group 64 asymmetric) and the widths of a 0.5B
model's MLP: time each, and check they choose the same ratio.

    python scripts/bench/awq_scale.py --threads 1 --rounds 2
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))

GROUPS = {"gate/up": (896, [4864, 4864]), "down": (4864, [896])}


def main() -> None:
    from compress.methods.awq import linear_error, output_error, search_scale
    from compress.format.quant import Scheme

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--rows", type=int, default=4096)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    scheme = Scheme(4, 64, False)
    for name, (width, outs) in GROUPS.items():
        x = torch.randn(args.rows, width, generator=g) * torch.rand(width, generator=g) * 3  # uneven channels
        ws = [torch.randn(o, width, generator=g) * 0.02 for o in outs]
        ref = torch.cat([x @ w.T for w in ws], -1)
        direct = output_error(lambda c: torch.cat([x @ w.T for w in c], -1), ref)
        for r in range(args.rounds):
            t0 = time.perf_counter()
            a = search_scale(x.abs().mean(0), ws, scheme, direct, 20)
            t1 = time.perf_counter()
            b = search_scale(x.abs().mean(0), ws, scheme, linear_error(x, ws), 20)
            t2 = time.perf_counter()
            print(f"{name} round {r + 1}: outputs {t1 - t0:.1f} s, linear_error {t2 - t1:.1f} s; ratio {a.ratio} vs "
                  f"{b.ratio}, loss {a.loss:.6g} vs {b.loss:.6g}", flush=True)


if __name__ == "__main__":
    main()
