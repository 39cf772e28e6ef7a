"""Export dtypes: the model's own by default, bfloat16 wherever its runtime computes in it, and float16 never
written for a model whose activations overflow it (a float16 forward of a few tokens decides)."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from tiny_models import byte_tokenizer, tiny_model

from compress.exporters.dispatch import FORMATS, export
from compress.exporters.dtypes import choose, first_overflow
from compress.format.checkpoint import load_quantized

from compress.format.quant import Scheme

from .models import quantize_model, save

IDS = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(0))
SCHEME = Scheme(4, 32)


def _folder(tmp_path, dtype=torch.float32, loud: bool = False):
    """A tiny quantized llama whose unquantized tensors are stored in ``dtype``; ``loud``: layer 0's MLP writes
    ~2e5 into the residual stream (a norm weight of ~30 and its own weights still far inside float16), as Gemma's
    activations do."""
    model = tiny_model("llama")
    if loud:
        layer = model.model.layers[0]
        down = layer.mlp.down_proj
        with torch.no_grad():
            layer.post_attention_layernorm.weight.mul_(30)
            out = {}
            h = down.register_forward_hook(lambda m, a, o: out.setdefault("max", o.abs().max()))
            model(IDS)
            h.remove()
            down.weight.mul_(2e5 / out["max"])
        assert down.weight.abs().max() < 6e4
    model = quantize_model(model, SCHEME).to(dtype)
    return save(model, tmp_path / "q", SCHEME, tokenizer=byte_tokenizer())


def test_choose_takes_the_request_then_the_models_own_then_the_formats():
    every = ("float32", "float16", "bfloat16")
    assert choose("gptq", "float32", torch.bfloat16, every, "bfloat16") == "float32"
    assert choose("gptq", None, torch.float16, every, "bfloat16") == "float16"
    assert choose("gptq", None, None, every, "bfloat16") == "bfloat16"
    assert choose("onnx", None, torch.bfloat16, ("float32", "float16"), "float32") == "float32"
    with pytest.raises(ValueError, match=r"--format onnx does not take --dtype bfloat16 \(ONNX Runtime's CPU"):
        choose("onnx", "bfloat16", None, ("float32", "float16"), "float32")
    with pytest.raises(ValueError, match="--dtype 'fp8' is not a dtype"):
        choose("gptq", "fp8", None, every, "bfloat16")


@pytest.mark.parametrize("fmt", ["compressed-tensors", "gptq", "awq"])
def test_safetensors_formats_default_to_the_models_own_dtype(tmp_path, fmt):
    src = _folder(tmp_path, torch.bfloat16)
    out = export(str(src), fmt, tmp_path / fmt)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["dtype"] == cfg["torch_dtype"] == "bfloat16"
    tensors = load_file(str(out / "model.safetensors"))
    assert tensors["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert torch.equal(tensors["model.embed_tokens.weight"], load_file(str(src / "model.safetensors"))[
        "model.embed_tokens.weight"])


def test_bfloat16_compressed_tensors_loads_in_transformers(tmp_path):
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    src = _folder(tmp_path, torch.bfloat16)
    out = export(str(src), "compressed-tensors", tmp_path / "ct", dtype="bfloat16")
    theirs = AutoModelForCausalLM.from_pretrained(out, quantization_config=CompressedTensorsConfig(dequantize=True))
    assert theirs.dtype == torch.bfloat16
    with torch.no_grad():
        got, ref = theirs(IDS).logits.float(), load_quantized(src)(IDS).logits
    assert float((got - ref).abs().max() / ref.abs().max()) < 0.05  # bf16 compute and bf16-rounded scales


@pytest.mark.parametrize("fmt,instead", [("compressed-tensors", "bfloat16"), ("gptq", "bfloat16"), ("awq", "bfloat16"),
                                         ("onnx", "float32"), ("onnx-int4", "float32")])
def test_float16_is_refused_for_a_model_that_overflows_it(tmp_path, fmt, instead):
    src = _folder(tmp_path, loud=True)
    with torch.no_grad():
        assert torch.isfinite(load_quantized(src)(IDS).logits).all()  # fine in fp32 (and bf16)
    with pytest.raises(ValueError, match=rf"--format {fmt} --dtype float16: this model overflows float16 .*"
                                         rf"model\.layers\.0\.mlp.* is inf/NaN.*use --dtype {instead}"):
        export(str(src), fmt, tmp_path / "out", dtype="float16")
    assert not (tmp_path / "out").exists()


def test_an_overflowing_model_exports_in_bfloat16_with_finite_logits(tmp_path):
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    src = _folder(tmp_path, loud=True)
    out = export(str(src), "compressed-tensors", tmp_path / "ct", dtype="bfloat16")
    theirs = AutoModelForCausalLM.from_pretrained(out, quantization_config=CompressedTensorsConfig(dequantize=True))
    with torch.no_grad():
        assert torch.isfinite(theirs(IDS).logits).all()
        half = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float16,
                                                    quantization_config=CompressedTensorsConfig(dequantize=True))
        assert not torch.isfinite(half(IDS).logits).all()  # what a float16 export would have produced


def test_float16_is_written_where_it_is_safe(tmp_path):
    src = _folder(tmp_path)
    out = export(str(src), "gptq", tmp_path / "g", dtype="float16")
    assert load_file(str(out / "model.safetensors"))["model.embed_tokens.weight"].dtype == torch.float16


def test_first_overflow_names_the_module():
    model = tiny_model("llama").half()
    with torch.no_grad():
        model.model.layers[1].self_attn.o_proj.weight.fill_(6e4)
    assert first_overflow(model, IDS).startswith("model.layers.1.self_attn")
    assert first_overflow(tiny_model("llama").half(), IDS) is None


def test_onnx_defaults_to_float32_and_gguf_takes_bfloat16(tmp_path):
    import gguf

    from .gguf_models import build

    assert FORMATS["onnx"].default_dtype == FORMATS["onnx-int4"].default_dtype == "float32"
    src = build(tmp_path / "q", "llama", Scheme(4, 32, sym=True))
    out = export(str(src), "gguf", tmp_path / "m.gguf", dtype="bfloat16")
    reader = gguf.GGUFReader(out)
    t = next(t for t in reader.tensors if t.name == "token_embd.weight")
    assert t.tensor_type.name == "BF16"
    ours = load_quantized(src).model.embed_tokens.weight.to(torch.bfloat16)
    raw = torch.from_numpy(np.array(t.data).copy()).view(torch.bfloat16).reshape(ours.shape)
    assert torch.equal(raw, ours)
    assert reader.fields["general.file_type"].contents() in (2, 3)  # the blocks' type names the file


@pytest.mark.parametrize("stream", [False, True])
def test_quantize_keeps_the_source_dtype_and_exports_follow_it(tmp_path, stream):
    """A bf16 checkpoint: `compress quantize` (in memory or streamed) stores what it does not quantize in bf16,
    and the export's default dtype is bf16 again, though the folder's config records the fp32 it computed in."""
    from compress.api import quantize
    from compress.format.models import declared_dtype, resolve
    from compress.format.shards import ShardReader

    model = tiny_model("llama").to(torch.bfloat16)
    model.save_pretrained(tmp_path / "fp")
    byte_tokenizer().save_pretrained(tmp_path / "fp")
    quantize(str(tmp_path / "fp"), recipe="rtn4", out=tmp_path / "q", stream=stream, group_size=32, embed="none",
             head="none")
    entries = ShardReader(tmp_path / "q").entries
    outer = {k: e.dtype for k, e in entries.items() if ".layers." not in k}
    assert outer and set(outer.values()) == {torch.bfloat16}, outer
    assert declared_dtype(resolve(str(tmp_path / "q"))) == torch.bfloat16
    out = export(str(tmp_path / "q"), "compressed-tensors", tmp_path / "ct")
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    # with the recipe's int8 table the fp tensors left (norms) still say bf16, not the fp16 of the table's scales
    quantize(str(tmp_path / "fp"), recipe="rtn4", out=tmp_path / "q8", stream=stream, group_size=32)
    assert declared_dtype(resolve(str(tmp_path / "q8"))) == torch.bfloat16


def test_a_gguf_source_keeps_its_outer_tensors_at_16_bits(tmp_path, monkeypatch):
    """A GGUF is read through its fp32 dequantized cache: the tensors left unquantized outside the blocks are written
    as bfloat16 (compress/exporters/dtypes.py's rule for a GGUF source), not widened, and both paths agree."""
    pytest.importorskip("gguf")
    from folders import folder_tensors

    from compress.config import load_recipe
    from compress.exporters.gguf import GGUFOptions
    from compress.job import quantize_to_folder

    from .gguf_models import build

    monkeypatch.setenv("COMPRESS_CACHE", str(tmp_path / "cache"))
    path = export(str(build(tmp_path / "q", "llama", Scheme(4, 32, True))), "gguf", tmp_path / "m.gguf",
                  options=GGUFOptions(embed_type="f16"))
    cfg = load_recipe("rtn4").replace(embed="none", head="none")
    a = folder_tensors(quantize_to_folder(str(path), cfg, str(tmp_path / "s"), stream=True).out)
    b = folder_tensors(quantize_to_folder(str(path), cfg, str(tmp_path / "m"), stream=False).out)
    assert a.keys() == b.keys() and [k for k in a if not torch.equal(a[k], b[k])] == []
    assert {a[k].dtype for k in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight")} == {torch.bfloat16}
