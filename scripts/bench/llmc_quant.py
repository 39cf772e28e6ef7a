"""llm-compressor's side of the benchmark: quantize the same fp model on the same calibration tokens with
its RTN / GPTQ / AWQ at the same scheme, then measure perplexity on the same windows.

Runs in its own venv (llm-compressor pins transformers <= 5.17):
  .venv-llmc/bin/python scripts/bench/llmc_quant.py --model FP_DIR --tokens runs/bench/tokens.pt --method gptq
"""
from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import window_ppl  # noqa: E402


METHODS = ("rtn", "gptq", "awq", "gptq-imatrix", "quip-gptq", "spinquant-gptq")


def modifier(method: str, bits: int, group: int, sym: bool):
    """The llm-compressor recipe of ``method``: its RTN, GPTQ (its defaults but damp 0.01) or AWQ; GPTQ with its
    ``imatrix_mse`` observer (ranges weighted by E[x^2], llama.cpp's importance matrix); GPTQ after its QuIP
    transform (an online random Hadamard on every linear's input, fused into the weights) or after its
    SpinQuant R1+R2 rotations (random Hadamards fused into the weights, no training)."""
    weights = {"num_bits": bits, "type": "int", "symmetric": sym, "strategy": "group", "group_size": group}
    if method == "gptq-imatrix":
        weights["observer"] = "imatrix_mse"
    scheme = {"group_0": {"targets": ["Linear"], "weights": weights}}
    if method == "rtn":
        from llmcompressor.modifiers.quantization import QuantizationModifier

        return QuantizationModifier(config_groups=scheme, ignore=["lm_head"])
    if method == "awq":
        from llmcompressor.modifiers.awq import AWQModifier

        return AWQModifier(config_groups=scheme, ignore=["lm_head"])
    if method not in METHODS:
        raise SystemExit(f"unknown method {method}; one of {', '.join(METHODS)}")
    from llmcompressor.modifiers.quantization import GPTQModifier

    gptq = GPTQModifier(config_groups=scheme, ignore=["lm_head"], dampening_frac=0.01)
    if method == "quip-gptq":
        from llmcompressor.modifiers.transform import QuIPModifier

        return [QuIPModifier(rotations=["v"], transform_type="random-hadamard"), gptq]
    if method == "spinquant-gptq":
        from llmcompressor.modifiers.transform import SpinQuantModifier

        return [SpinQuantModifier(rotations=["R1", "R2"], transform_type="random-hadamard"), gptq]
    return gptq


@torch.no_grad()
def bake_fake_quant(model) -> int:
    """Replace each quantized weight by its dequantized value: the same numbers whether or not the
    module's forward also fake-quantizes (re-quantizing a grid point with its own qparams is exact)."""
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize

    n = 0
    for m in model.modules():
        scheme = getattr(m, "quantization_scheme", None)
        if scheme is None or scheme.weights is None or not hasattr(m, "weight_scale"):
            continue
        zp = getattr(m, "weight_zero_point", None)
        g_idx = getattr(m, "weight_g_idx", None)
        if g_idx is not None and (g_idx >= 0).all() and not torch.equal(g_idx, torch.arange(g_idx.numel()) // scheme.weights.group_size):
            raise SystemExit("this compressed-tensors' fake_quantize takes no g_idx; run without group act-order")
        m.weight.data = fake_quantize(m.weight.data, m.weight_scale, zp, scheme.weights)
        n += 1
    return n


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokens", required=True)
    ap.add_argument("--method", required=True)
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--sym", action="store_true")
    ap.add_argument("--nsamples", type=int, default=0, help="use the first N calibration windows (0: all)")
    ap.add_argument("--json", required=True)
    a = ap.parse_args()
    from datasets import Dataset
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM

    if not torch.cuda.is_available():  # llm-compressor 0.14 pins its activation cache, which needs a GPU
        from llmcompressor.pipelines.cache import IntermediatesCache

        IntermediatesCache.pin_memory = lambda self, *args, **kwargs: None
    tokens = torch.load(a.tokens)
    calib = tokens["calib"][: a.nsamples or None]
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    ds = Dataset.from_dict({"input_ids": calib.tolist(), "attention_mask": torch.ones_like(calib).tolist()})
    t0 = time.perf_counter()
    oneshot(model=model, dataset=ds, recipe=modifier(a.method, a.bits, a.group_size, a.sym),
            max_seq_length=calib.shape[1], num_calibration_samples=calib.shape[0])
    seconds = time.perf_counter() - t0
    n = bake_fake_quant(model)
    print(f"fake-quantized {n} weights in place", file=sys.stderr)
    result = {"method": a.method, "seconds": seconds,
              "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
              "ppl": {name: window_ppl(model, w) for name, w in tokens["eval"].items()}}
    Path(a.json).write_text(json.dumps(result, indent=2))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
