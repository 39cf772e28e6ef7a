"""Every family's awq4 folder (tests/compress/format/test_families.py makes them) exported and read back by others'
code: transformers loads the compressed-tensors export with our logits; GPTQ and AWQ exports decoded by reference
unpackers give our logits in the family's transformers model; ONNX Runtime runs the onnx-int4 export of each
family the table marks ``onnx``, with its key/value cache past the sliding window; MoE folders are refused by the
formats that cannot carry packed experts."""
from __future__ import annotations

import json

import pytest
import torch
from tiny_models import BLOCK_VARIANTS, FAMILIES, MOE_FAMILIES, one_thread, quantize_tiny

from compress.exporters.dispatch import export
from compress.format.checkpoint import load_quantized, quantized_modules
from compress.format.families import supports

from .test_awq import reference_dequantize as awq_dequantize
from .test_gptq import reference_dequantize as gptq_dequantize

ct = pytest.importorskip("compressed_tensors")  # verification dependency (dev extra)

IDS = torch.randint(0, 256, (2, 18), generator=torch.Generator().manual_seed(2))  # past gemma's window of 8


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with one_thread():
        yield


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """folder(family) -> the family's tiny model quantized by awq4 and saved, built once."""
    cache = {}

    def build(family: str):
        if family not in cache:
            cache[family] = tmp_path_factory.mktemp("q") / family
            quantize_tiny(family, "awq4", cache[family])
        return cache[family]

    return build


def _logits(model, ids=IDS):
    with torch.no_grad():
        return model(ids).logits


def _close(got, ref, tol):
    assert float((got - ref).abs().max() / ref.abs().max()) <= tol


@pytest.mark.parametrize("family", FAMILIES)
def test_compressed_tensors_loads_in_transformers_with_our_logits(folder, family, tmp_path):
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    src = folder(family)
    out = export(str(src), "compressed-tensors", tmp_path / "ct")  # the model's own dtype: fp32 here
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"
    theirs = AutoModelForCausalLM.from_pretrained(out, quantization_config=CompressedTensorsConfig(dequantize=True))
    _close(_logits(theirs.eval()), _logits(load_quantized(src)), 1e-5)


def _decoded(out, unpack) -> torch.nn.Module:
    """The family's transformers model holding the export's fp tensors and its integers decoded by ``unpack``."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = json.loads((out / "config.json").read_text())
    qc = cfg.pop("quantization_config")
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg.pop("model_type"), **cfg), dtype=torch.float32)
    tensors = load_file(str(out / "model.safetensors"))
    layers = {k.rsplit(".", 1)[0] for k in tensors if k.endswith(".qweight")}
    state = {k: v for k, v in tensors.items() if k.rsplit(".", 1)[0] not in layers or k.endswith(".bias")}
    state.update({f"{n}.weight": unpack(tensors, n, qc) for n in layers})
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    if missing:
        model.tie_weights()
    return model.eval()


def _gptq(t, n, qc):
    return gptq_dequantize(t[f"{n}.qweight"], t[f"{n}.qzeros"], t[f"{n}.scales"], t[f"{n}.g_idx"], qc["bits"])


def _awq(t, n, qc):
    return awq_dequantize(t[f"{n}.qweight"], t[f"{n}.qzeros"], t[f"{n}.scales"], qc["group_size"])


@pytest.mark.parametrize("family", FAMILIES)
def test_gptq_and_awq_exports_decode_to_our_logits(folder, family, tmp_path):
    src = folder(family)
    ours = load_quantized(src)
    ref = _logits(ours)
    for fmt, unpack in (("gptq", _gptq), ("awq", _awq)):
        out = export(str(src), fmt, tmp_path / fmt)
        model = _decoded(out, unpack)
        assert sum(n.endswith(".qweight") for n in model.state_dict()) == 0
        _close(_logits(model), ref, 1e-5)


# each export traces the whole model (~5-10 s here); every family in the default run, as issue 15 asks
@pytest.mark.parametrize("family", [f for f in BLOCK_VARIANTS if supports(f, "onnx")])
def test_onnx_int4_runs_the_family_with_its_cache(folder, family, tmp_path):
    """Prompt, then a cache step: the same logits as one pass of the quantized torch model (MatMulNBits' fp32
    accumulation order aside), across gemma's sliding window (8 tokens) and its global layers."""
    import numpy as np

    from compress.exporters.onnx_runner import OnnxCausalLM

    src = folder(family)
    ours = load_quantized(src)
    onnx = OnnxCausalLM(export(str(src), "onnx-int4", tmp_path / "onnx"))
    ids, mask = IDS.numpy(), np.ones(IDS.shape, np.int64)
    first, past = onnx.step(ids[:, :11], mask[:, :11], onnx._empty_past(2))
    second, present = onnx.step(ids[:, 11:], mask, past)
    assert present[0].shape[2] == IDS.shape[1]
    got = torch.from_numpy(np.concatenate([first, second], axis=1))
    _close(got, _logits(ours), 1e-3)
    assert len(quantized_modules(ours)) > 0


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_moe_folders_are_refused_by_the_per_linear_formats(folder, family, tmp_path):
    src = folder(family)
    for fmt in ("compressed-tensors", "gptq", "awq"):
        with pytest.raises(ValueError, match=f"--format {fmt} cannot carry .*packed MoE experts") as e:
            export(str(src), fmt, tmp_path / fmt)
        assert "gguf" in str(e.value) and not (tmp_path / fmt).exists()
