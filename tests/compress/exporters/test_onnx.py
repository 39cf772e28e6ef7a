"""ONNX fp export: optimum's I/O contract, dynamic lengths, and ONNX Runtime greedy == torch greedy."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from compress.exporters.dispatch import export
from compress.exporters.onnx_fp import input_names, output_names
from compress.exporters.onnx_runner import OnnxCausalLM, greedy_generate, position_ids
from compress.format.checkpoint import load_quantized

IDS = torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(1))


def _logits(model, ids, mask=None):
    mask = torch.ones_like(ids) if mask is None else mask
    pos = torch.from_numpy(position_ids(mask.numpy(), ids.shape[1]))
    with torch.no_grad():
        return model(ids, attention_mask=mask, position_ids=pos).logits


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_quantized_model_exports_dequantized_and_generates_like_torch(exported, family):
    src, out = exported("onnx", family=family, group=32, sym=False)
    ours, onnx = load_quantized(src), OnnxCausalLM(out)
    assert [i.name for i in onnx.session.get_inputs()] == input_names(2)
    assert [o.name for o in onnx.session.get_outputs()] == output_names(2)
    ids_dims, past_dims = onnx.session.get_inputs()[0].shape, onnx.session.get_inputs()[-1].shape
    assert all(isinstance(d, str) for d in (*ids_dims, past_dims[0], past_dims[2])), "lengths must be dynamic"
    torch.testing.assert_close(onnx(IDS).logits, _logits(ours, IDS), rtol=1e-4, atol=1e-4)
    assert greedy_generate(onnx, IDS[:1], 16).tolist() == greedy_generate(ours, IDS[:1], 16).tolist()
    for name in ("config.json", "generation_config.json", "tokenizer.json"):
        assert (out / name).is_file()


def test_left_padded_batch_matches_torch(exported):
    src, out = exported("onnx", family="llama", group=32, sym=False)
    ours, onnx = load_quantized(src), OnnxCausalLM(out)
    mask = torch.ones_like(IDS)
    mask[1, :3] = 0
    got, ref = onnx(IDS, mask).logits, _logits(ours, IDS, mask)
    torch.testing.assert_close(got[1, 3:], ref[1, 3:], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got[0], ref[0], rtol=1e-4, atol=1e-4)


def test_cache_steps_agree_with_one_full_pass(exported):
    _, out = exported("onnx", family="llama", group=32, sym=False)
    onnx = OnnxCausalLM(out)
    ids, mask = IDS.numpy(), np.ones(IDS.shape, np.int64)
    full, _ = onnx.step(ids, mask, onnx._empty_past(2))
    first, past = onnx.step(ids[:, :4], mask[:, :4], onnx._empty_past(2))
    second, present = onnx.step(ids[:, 4:], mask, past)
    assert present[0].shape[2] == 7
    np.testing.assert_allclose(np.concatenate([first, second], 1), full, rtol=1e-4, atol=1e-4)


def test_plain_hf_folder_exports(tmp_path):
    from .models import byte_tokenizer, tiny_model

    model = tiny_model("gemma")
    model.save_pretrained(tmp_path / "fp")
    byte_tokenizer().save_pretrained(tmp_path / "fp")
    out = export(str(tmp_path / "fp"), "onnx", tmp_path / "onnx")
    assert greedy_generate(OnnxCausalLM(out), IDS[:1], 12).tolist() == greedy_generate(model, IDS[:1], 12).tolist()
    with pytest.raises(ValueError, match="needs a quantized model"):
        export(str(tmp_path / "fp"), "onnx-int4", tmp_path / "int4")


def test_float16_export(exported):
    src, out = exported("onnx", "float16", family="qwen2", group=32, sym=True)
    onnx = OnnxCausalLM(out)
    assert onnx.np_dtype == np.float16
    ref = _logits(load_quantized(src), IDS)
    got = onnx(IDS).logits
    assert float((got - ref).abs().max() / ref.abs().max()) < 1e-2


def test_unsupported_architecture_is_named(tmp_path):
    from transformers import AutoModelForCausalLM, GPT2Config

    from .models import byte_tokenizer

    model = AutoModelForCausalLM.from_config(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=256))
    model.save_pretrained(tmp_path / "gpt2")
    byte_tokenizer().save_pretrained(tmp_path / "gpt2")
    with pytest.raises(ValueError, match="model_type 'gpt2'") as e:
        export(str(tmp_path / "gpt2"), "onnx", tmp_path / "out")
    assert "llama" in str(e.value) and "gemma" in str(e.value)
    assert not (tmp_path / "out").exists() and list(tmp_path.iterdir()) == [tmp_path / "gpt2"]
