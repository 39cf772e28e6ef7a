"""compressed-tensors pack-quantized: the library itself decompresses our export to our exact weights,
and transformers loads it into a model with our logits."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from compress.exporters.dispatch import export
from compress.format.checkpoint import load_quantized

ct = pytest.importorskip("compressed_tensors")  # verification dependency (dev extra)

CASES = [  # (family, bits, group, sym)
    ("llama", 4, 32, False), ("llama", 4, 32, True), ("qwen2", 4, -1, False), ("mistral", 8, 32, True),
    ("gemma", 4, 64, False), ("llama", 2, 32, False),
]


@pytest.mark.parametrize("family,bits,group,sym", CASES)
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_library_decompresses_to_our_weights_bit_identically(exported, family, bits, group, sym, dtype):
    from compressed_tensors.compressors.pack_quantized import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig

    src, out = exported("compressed-tensors", dtype, family=family, bits=bits, group=group, sym=sym)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    cfg = QuantizationConfig.model_validate(qc)
    (scheme,) = [g for g in cfg.config_groups.values()]
    tensors = load_file(str(out / "model.safetensors"))
    model = load_quantized(src)
    torch_dtype = getattr(torch, dtype)
    assert (out / "config.json").is_file() and json.loads((out / "config.json").read_text())["torch_dtype"] == dtype
    n = 0
    for name, m in model.named_modules():
        if not hasattr(m, "qweight"):
            continue
        local = {k.removeprefix(name + "."): v for k, v in tensors.items() if k.startswith(name + ".weight")}
        assert ("weight_zero_point" in local) == (not sym)
        got = PackedQuantizationCompressor.decompress(local, scheme)["weight"]
        assert got.dtype == torch_dtype
        assert torch.equal(got, m.dequantized_weight(torch_dtype)), name
        # and the library's own compressor, given our weights and qparams, writes the very same tensors
        given = {"weight": m.dequantized_weight(torch.float32), "weight_scale": m.scales.float()}
        if not sym:
            given["weight_zero_point"] = (m.qzeros.to(torch.int16) - 2 ** (bits - 1)).to(torch.int8)
        theirs = PackedQuantizationCompressor.compress(given, scheme)
        assert torch.equal(theirs["weight_packed"], local["weight_packed"]), name
        assert torch.equal(theirs["weight_shape"], local["weight_shape"]), name
        if not sym:
            assert torch.equal(theirs["weight_zero_point"], local["weight_zero_point"]), name
        n += 1
    assert n == 14 and "lm_head" in qc["ignore"]


@pytest.mark.parametrize("family,bits,group,sym", [c for c in CASES if c[1] == 4])
def test_transformers_loads_it_with_our_logits(exported, family, bits, group, sym):
    """Symmetric checkpoints load compressed; asymmetric ones through ``dequantize=True``: transformers'
    compressed path sizes weight_zero_point unpacked ([out, G]) while the library packs it along out
    (llm-compressor issue #1618), so it cannot load any asymmetric pack-quantized checkpoint."""
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    src, out = exported("compressed-tensors", "float32", family=family, bits=bits, group=group, sym=sym)
    ours = load_quantized(src)
    extra = {} if sym else {"quantization_config": CompressedTensorsConfig(dequantize=True)}
    theirs = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, **extra).eval()
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = ours(ids).logits, theirs(ids).logits
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("recipe,why", [
    (dict(family="llama", hidden=80, group=32), "ragged"),
    (dict(family="llama", act_order=True), "act-order"),
    (dict(family="llama", bits=3), "3-bit"),
    (dict(family="llama", fmt="nf4", sym=True), "nf4"),
])
def test_refuses_what_it_cannot_carry_and_names_who_can(quantized_dir, tmp_path, recipe, why):
    src = quantized_dir(**recipe)
    with pytest.raises(ValueError, match="compressed-tensors cannot carry") as e:
        export(str(src), "compressed-tensors", tmp_path / "out")
    assert why in str(e.value) and "Formats that can" in str(e.value)
    if why in ("ragged", "act-order", "3-bit"):
        assert "gptq" in str(e.value)
    assert not (tmp_path / "out").exists()
