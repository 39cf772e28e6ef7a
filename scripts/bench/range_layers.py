"""Layer-level comparison of how each method picks its grid, on SmolLM2's real activations, with and without
the Hadamard rotation: the output error ``tr(D H D^T)`` (``D`` = dequantized - original weight, ``H`` the layer's
input Hessian from 8 calibration windows) of RTN, RTN with the activation-weighted range (compress.format.quant.
weighted_range_params), GPTQ, GPTQ with the mse grid (the recipes' choice) and GPTQ with the weighted range.

  .venv/bin/python scripts/bench/range_layers.py   # needs runs/bench/fp and tokens.pt (scripts/bench/quant.py)
"""
from __future__ import annotations

import copy
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

LAYERS = {"q_proj L10": (10, "self_attn.q_proj"), "o_proj L10": (10, "self_attn.o_proj"),
          "down_proj L10": (10, "mlp.down_proj"), "up_proj L20": (20, "mlp.up_proj")}


def hessians(model, tokens) -> dict:
    from compress.methods.common.hessian import Hessian

    mods = {k: model.model.layers[i].get_submodule(n) for k, (i, n) in LAYERS.items()}
    hs = {k: Hessian.zeros(m.in_features) for k, m in mods.items()}
    hooks = [m.register_forward_pre_hook(lambda mod, a, k=k: hs[k].add(a[0])) for k, m in mods.items()]
    with torch.no_grad():
        for batch in tokens.split(4):
            model(input_ids=batch)
    for h in hooks:
        h.remove()
    return {k: (mods[k].weight.data, hs[k].H) for k in mods}


def errors(w, h, scheme) -> dict:
    from compress.config import GPTQOptions
    from compress.format import quant
    from compress.methods.common import gptq_solver

    def err(qw):
        d = qw.dequantize() - w
        return torch.einsum("oi,ij,oj->", d, h, d).item()

    def g(mse=False, weighted_range=False):
        opts = GPTQOptions(damp=0.05, act_order=True, static_groups=True, mse=mse)
        return gptq_solver.quantize_weight(w, h, scheme, opts, weighted_range).weight

    return {"rtn": err(quant.quantize_weight(w, scheme)),
            "rtn weighted": err(quant.quantize_weight(w, scheme, h.diagonal())),
            "gptq": err(g()), "gptq mse": err(g(mse=True)), "gptq weighted": err(g(weighted_range=True))}


def main():
    from compress.format.models import load_model
    from compress.format.quant import Scheme
    from compress.transforms.rotate import rotate_model

    model, _, _ = load_model(str(ROOT / "runs/bench/fp"))
    tokens = torch.load(ROOT / "runs/bench/tokens.pt")["calib"][:8]
    rotated = copy.deepcopy(model)
    rotate_model(rotated, "hadamard", 0)
    t0 = time.time()
    print("| model | bits | layer | rtn | rtn weighted | gptq | gptq mse | gptq weighted |")
    print("|---|---|---|---:|---:|---:|---:|---:|")
    for label, m in (("fp", model), ("rotated", rotated)):
        for k, (w, h) in hessians(m, tokens).items():
            for bits in (4, 3):
                e = errors(w, h, Scheme(bits, 64, False))
                print(f"| {label} | {bits} | {k} | " + " | ".join(f"{v:.3g}" for v in e.values()) + " |", flush=True)
    print(f"{time.time() - t0:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
