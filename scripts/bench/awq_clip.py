"""AWQ's clipping search (compress/methods/awq.py ``search_clip``, scored through each group's Gram matrix) against the
same search scored directly over every sample row, on awq4's settings (2,048 rows, a 50-step grid) and the widths of
a 0.5B model's MLP: time each, and check they choose the same range for every (row, group).

    python scripts/bench/awq_clip.py --threads 1
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))


def direct_search(x, w, scheme, grid, max_shrink=0.5, chunk=256):
    """The same search with each candidate's error taken over the sample rows themselves: [G, n, rows] per step.
    The bench's full-range bounds are the asymmetric ones (its scheme), as the search before the Gram form."""
    from compress.methods.common.clip import grouped, shrink_search

    xg = grouped(x.float(), scheme).permute(1, 0, 2)  # [G, n, g]
    return shrink_search(w, scheme, lambda dq: torch.bmm(xg, dq.transpose(1, 2)).pow_(2).mean(dim=1).T, grid,
                         max_shrink, chunk)


def main() -> None:
    from compress.format.quant import Scheme
    from compress.methods.common.clip import search_clip

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--grid", type=int, default=50)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    g, scheme = torch.Generator().manual_seed(0), Scheme(4, 64, False)
    for name, (out_f, in_f) in {"down_proj 896 x 4864": (896, 4864), "up_proj 4864 x 896": (4864, 896)}.items():
        x, w = torch.randn(args.rows, in_f, generator=g), torch.randn(out_f, in_f, generator=g) * 0.02
        t = time.perf_counter()
        ref = direct_search(x, w, scheme, args.grid)
        t_direct = time.perf_counter() - t
        t = time.perf_counter()
        got = search_clip(x, w, scheme, args.grid)
        t_gram = time.perf_counter() - t
        same = float((ref.hi == got.hi).float().mean())
        print(f"{name}: direct {t_direct:.1f} s, gram {t_gram:.1f} s ({t_direct / t_gram:.1f}x), same choice {same:.4f}")


if __name__ == "__main__":
    main()
