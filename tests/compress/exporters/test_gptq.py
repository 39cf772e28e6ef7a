"""GPTQ v1 and v2: a reference unpacker written from AutoGPTQ's documented math (v2: GPTQModel's exact zeros)
reproduces our weights exactly."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from compress.exporters.dispatch import export
from compress.format.checkpoint import load_quantized, quantized_modules


def _unpack_rows(words: np.ndarray, bits: int) -> np.ndarray:
    """AutoGPTQ's unpacking of int32 words along axis 0 (qweight) into codes, [words, cols] -> [n, cols]."""
    w = words.astype(np.int64) & 0xFFFFFFFF
    if bits in (2, 4, 8):
        shifts = np.arange(0, 32, bits)  # wf
        codes = (w[:, None, :] >> shifts[None, :, None]) & (2**bits - 1)
        return codes.reshape(-1, w.shape[1])
    # 3 bits, as qlinear_cuda_old: 3 words carry 32 codes; codes 10 and 21 straddle word boundaries
    w = w.reshape(-1, 3, w.shape[1])
    wf = np.array([[0, 3, 6, 9, 12, 15, 18, 21, 24, 27, 30, 0],
                   [0, 1, 4, 7, 10, 13, 16, 19, 22, 25, 28, 31],
                   [0, 2, 5, 8, 11, 14, 17, 20, 23, 26, 29, 0]])
    c = w[:, :, None, :] >> wf[None, :, :, None]  # [n/32, 3, 12, cols]
    c[:, 0, 10] = (c[:, 0, 10] & 0x3) | ((c[:, 1, 0] << 2) & 0x4)
    c[:, 1, 11] = (c[:, 1, 11] & 0x1) | ((c[:, 2, 0] << 1) & 0x6)
    c = c & 0x7
    codes = np.concatenate([c[:, 0, :11], c[:, 1, 1:12], c[:, 2, 1:11]], axis=1)  # [n/32, 32, cols]
    return codes.reshape(-1, w.shape[2])


def reference_dequantize(qweight, qzeros, scales, g_idx, bits: int, offset: int = 1) -> torch.Tensor:
    """w[i, o] = scales[g_idx[i], o] * (q[i, o] - (z[g_idx[i], o] + offset)), returned as [out, in]; offset 1 in
    v1, 0 in v2."""
    q = _unpack_rows(qweight.numpy(), bits)  # [in, out]
    z = _unpack_rows(qzeros.numpy().T, bits).T + offset  # qzeros packs along out: [G, out]
    g = g_idx.numpy().astype(np.int64)
    s = scales.float().numpy()
    w = s[g] * (q - z[g]).astype(np.float32)
    return torch.from_numpy(w.T.copy())


CASES = [  # (family, bits, group, sym, act_order, hidden)
    ("llama", 4, 32, False, False, 64), ("llama", 4, 32, True, True, 64), ("qwen2", 4, 32, False, True, 64),
    ("mistral", 4, -1, True, False, 64), ("gemma", 4, 32, False, False, 80),  # 80 % 32: ragged last group
    ("llama", 4, 32, True, True, 80), ("qwen2", 8, 32, False, False, 64), ("llama", 3, 32, False, True, 64),
    ("mistral", 2, 64, True, False, 64),
]


@pytest.mark.parametrize("family,bits,group,sym,act_order,hidden", CASES)
def test_reference_unpacker_reproduces_our_weights(exported, family, bits, group, sym, act_order, hidden):
    src, out = exported("gptq", family=family, bits=bits, group=group, sym=sym, act_order=act_order, hidden=hidden)
    tensors = load_file(str(out / "model.safetensors"))
    layers = quantized_modules(load_quantized(src))
    for name, m in layers.items():
        qw, qz = tensors[f"{name}.qweight"], tensors[f"{name}.qzeros"]
        sc, gi = tensors[f"{name}.scales"], tensors[f"{name}.g_idx"]
        n_groups = -(-m.in_features // m.scheme.group(m.in_features))
        assert qw.shape == (m.in_features * bits // 32, m.out_features) and qw.dtype == torch.int32
        assert qz.shape == (n_groups, m.out_features * bits // 32) and qz.dtype == torch.int32
        assert sc.shape == (n_groups, m.out_features) and sc.dtype == torch.float16
        assert gi.shape == (m.in_features,) and gi.dtype == torch.int32
        assert torch.equal(reference_dequantize(qw, qz, sc, gi, bits), m.dequantized_weight(torch.float32)), name
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc == json.loads((out / "quantize_config.json").read_text())
    assert (qc["quant_method"], qc["checkpoint_format"], qc["bits"], qc["group_size"], qc["sym"], qc["desc_act"]) == (
        "gptq", "gptq", bits, group, sym, act_order)
    assert "model.embed_tokens.weight" in tensors and not qc["lm_head"]


def test_layers_outside_the_common_scheme_are_listed_in_dynamic(tmp_path):
    from compress.format.quant import Scheme
    from .models import quantize_model, save, tiny_model

    model = quantize_model(tiny_model("llama"), Scheme(4, 32))
    from compress.format.checkpoint import set_module
    from compress.format.qlinear import QuantLinear
    from compress.format.quant import quantize_weight

    down = model.model.layers[1].mlp.down_proj
    set_module(model, "model.layers.1.mlp.down_proj",
               QuantLinear.from_quantized(quantize_weight(down.dequantized_weight(), Scheme(8, 64, sym=True))))
    lin = model.model.layers[0].mlp.up_proj
    set_module(model, "model.layers.0.mlp.up_proj", torch.nn.Linear(lin.in_features, lin.out_features, bias=False))
    save(model, tmp_path / "q", Scheme(4, 32))
    out = export(str(tmp_path / "q"), "gptq", tmp_path / "g")
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["dynamic"] == {"+:^model[.]layers[.]1[.]mlp[.]down_proj$": {"bits": 8, "group_size": 64, "sym": True},
                             "-:^model[.]layers[.]0[.]mlp[.]up_proj$": {}}
    assert "model.layers.0.mlp.up_proj.weight" in load_file(str(out / "model.safetensors"))


@pytest.mark.parametrize("recipe,why", [
    (dict(family="llama", fmt="nf4", sym=True), "nf4"),
    (dict(family="llama", bits=3, hidden=80), "multiples of 32"),
])
def test_refuses_what_v1_cannot_carry(quantized_dir, tmp_path, recipe, why):
    with pytest.raises(ValueError, match="gptq cannot carry") as e:
        export(str(quantized_dir(**recipe)), "gptq", tmp_path / "out")
    assert why in str(e.value)
    assert not (tmp_path / "out").exists()


def test_zero_point_zero_is_written_as_v2_with_exact_zeros(tmp_path):
    """v1 cannot store a zero of 0 ('zero - 1' wraps): the model goes out as gptq_v2, every layer's zeros exact."""
    from compress.format.quant import Scheme
    from .models import quantize_model, save, tiny_model

    model = quantize_model(tiny_model("llama"), Scheme(4, 32))
    q_proj = model.model.layers[0].self_attn.q_proj
    q_proj.qzeros[3, 1] = 0
    save(model, tmp_path / "q", Scheme(4, 32))
    out = export(str(tmp_path / "q"), "gptq", tmp_path / "out")
    qc = json.loads((out / "quantize_config.json").read_text())
    assert qc["checkpoint_format"] == "gptq_v2"
    assert json.loads((out / "config.json").read_text())["quantization_config"] == qc
    tensors = load_file(str(out / "model.safetensors"))
    for name, m in quantized_modules(load_quantized(tmp_path / "q")).items():
        got = reference_dequantize(tensors[f"{name}.qweight"], tensors[f"{name}.qzeros"], tensors[f"{name}.scales"],
                                   tensors[f"{name}.g_idx"], 4, offset=0)
        assert torch.equal(got, m.dequantized_weight(torch.float32)), name


@pytest.mark.parametrize("zero_floor,fmt", [(0, "gptq_v2"), (1, "gptq")])
def test_zero_floor_one_keeps_a_checkpoint_in_v1(tmp_path, zero_floor, fmt):
    """Non-negative groups get zero 0 by min/max rounding (v2); quantized with zero_floor 1 the same model is v1,
    and the floor travels in the checkpoint's scheme."""
    from compress.format.quant import Scheme
    from .models import quantize_model, save, tiny_model

    model = tiny_model("llama")
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight[:, :32].abs_()
    scheme = Scheme(4, 32, zero_floor=zero_floor)
    save(quantize_model(model, scheme), tmp_path / "q", scheme)
    out = export(str(tmp_path / "q"), "gptq", tmp_path / "g")
    assert json.loads((out / "quantize_config.json").read_text())["checkpoint_format"] == fmt
    layers = quantized_modules(load_quantized(tmp_path / "q"))
    assert all(m.scheme.zero_floor == zero_floor for m in layers.values())
    tensors = load_file(str(out / "model.safetensors"))
    name, m = "model.layers.0.mlp.up_proj", layers["model.layers.0.mlp.up_proj"]
    got = reference_dequantize(tensors[f"{name}.qweight"], tensors[f"{name}.qzeros"], tensors[f"{name}.scales"],
                               tensors[f"{name}.g_idx"], 4, offset=1 if fmt == "gptq" else 0)
    assert torch.equal(got, m.dequantized_weight(torch.float32))
