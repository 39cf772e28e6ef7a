"""AutoAWQ GEMM: a reference unpacker written from AutoAWQ's documented math reproduces our weights exactly."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from compress.exporters.dispatch import export
from compress.format.checkpoint import load_quantized, quantized_modules

AWQ_REVERSE_ORDER = [0, 4, 1, 5, 2, 6, 3, 7]


def _unpack_columns(packed: torch.Tensor) -> torch.Tensor:
    """AutoAWQ's unpack_awq + reverse_awq_order: int32 [rows, n / 8] -> codes [rows, n]."""
    shifts = torch.arange(0, 32, 4)
    codes = (packed[:, :, None] >> shifts[None, None, :]).reshape(packed.shape[0], -1)
    order = torch.arange(codes.shape[1]).reshape(-1, 8)[:, AWQ_REVERSE_ORDER].reshape(-1)
    return codes[:, order] & 0xF


def reference_dequantize(qweight, qzeros, scales, group_size: int) -> torch.Tensor:
    """(q - z) * s with zeros and scales repeated over each group's rows, returned as [out, in]."""
    q, z = _unpack_columns(qweight), _unpack_columns(qzeros)
    z = z.repeat_interleave(group_size, dim=0)
    s = scales.float().repeat_interleave(group_size, dim=0)
    return ((q - z).float() * s).t()


@pytest.mark.parametrize("family,group,sym", [("llama", 32, False), ("qwen2", 32, True), ("mistral", -1, False),
                                              ("gemma", 64, True)])
def test_reference_unpacker_reproduces_our_weights(exported, family, group, sym):
    src, out = exported("awq", family=family, group=group, sym=sym)
    tensors = load_file(str(out / "model.safetensors"))
    for name, m in quantized_modules(load_quantized(src)).items():
        qw, qz, sc = tensors[f"{name}.qweight"], tensors[f"{name}.qzeros"], tensors[f"{name}.scales"]
        g = m.scheme.group(m.in_features)
        assert qw.shape == (m.in_features, m.out_features // 8) and qz.shape == (m.in_features // g, m.out_features // 8)
        assert sc.shape == (m.in_features // g, m.out_features) and sc.dtype == torch.float16
        if sym:
            assert bool((_unpack_columns(qz) == 8).all())
        assert torch.equal(reference_dequantize(qw, qz, sc, g), m.dequantized_weight(torch.float32)), name
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc == {"quant_method": "awq", "version": "gemm", "bits": 4, "group_size": group, "zero_point": True,
                  "modules_to_not_convert": ["lm_head"]}


@pytest.mark.parametrize("recipe,why", [
    (dict(family="llama", bits=8), "4-bit only"),
    (dict(family="llama", act_order=True), "g_idx"),
    (dict(family="llama", hidden=80), "ragged"),
])
def test_refuses_what_awq_cannot_carry(quantized_dir, tmp_path, recipe, why):
    with pytest.raises(ValueError, match="awq cannot carry") as e:
        export(str(quantized_dir(**recipe)), "awq", tmp_path / "out")
    assert why in str(e.value) and "gptq" in str(e.value)
    assert not (tmp_path / "out").exists()
