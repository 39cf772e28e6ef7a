"""The Python API mirrors the CLI: compress.quantize / evaluate / export and runtime.LLM."""
import subprocess
import sys

import pytest
import torch

import compress
import runtime


def test_importing_the_packages_loads_nothing_heavy():
    code = "import compress, runtime, sys; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_quantize_evaluate_and_generate_through_the_api(tiny_dir, calib_text, tmp_path):
    from compress.format.models import load_model

    out = tmp_path / "q"
    summary = compress.quantize(str(tiny_dir), recipe="gptq4", out=out, calib=str(calib_text), nsamples=4, seqlen=32,
                                group_size=32)
    assert summary.out == str(out) and summary.out_bytes > 0 and summary.report.method == "gptq"
    model, _, _ = load_model(str(out))
    # the blocks' linears take the override; the int8 embedding and head keep their own per-row scheme
    assert all(q.scheme.group_size == 32 for n, q in model.named_modules() if hasattr(q, "scheme") and ".layers." in n)
    with pytest.raises(FileExistsError, match="--overwrite"):
        compress.quantize(str(tiny_dir), recipe="rtn4", out=out)

    result = compress.evaluate(str(out), baseline=str(tiny_dir), ppl=[str(calib_text)], seqlen=32, max_windows=2,
                               progress=None)
    assert result.compressed.ppl and result.baseline.ppl and result.delta is not None
    assert result["delta"] is result.delta  # the dict keys of old still read (README)

    llm = runtime.LLM(str(out), kv_cache_memory=1 << 22, dtype="float32", quant_kernel="dequant")
    params = runtime.SamplingParams(max_tokens=6, ignore_eos=True)
    got = llm.generate(["the quick brown fox", "a gentle breeze"], params)
    ids = llm.tokenizer("the quick brown fox", return_tensors="pt").input_ids
    with torch.no_grad():
        want = model.generate(ids, max_new_tokens=6, do_sample=False)[0, ids.shape[1]:].tolist()
    assert got[0].token_ids == want and len(got[1].token_ids) == 6


def test_an_unknown_override_is_refused_by_name(tiny_dir, tmp_path):
    with pytest.raises(ValueError, match="nsample"):
        compress.quantize(str(tiny_dir), recipe="rtn4", out=tmp_path / "q", nsample=4)
    assert not (tmp_path / "q").exists()


def test_export_through_the_api(tiny_dir, tmp_path):
    from compress.exporters.dispatch import FORMATS

    q = compress.quantize(str(tiny_dir), recipe="rtn4", out=tmp_path / "q").out
    with pytest.raises(ValueError, match="--dequantize-embedding"):  # rtn4's int8 table has no compressed-tensors form
        compress.export(q, "compressed-tensors", tmp_path / "ct")
    path = compress.export(q, "compressed-tensors", tmp_path / "ct", dequantize_embedding=True)
    assert (path / "config.json").is_file() and "compressed-tensors" in FORMATS
    with pytest.raises(ValueError, match="apply to format gguf"):
        compress.export(q, "gptq", tmp_path / "g", k_quants=True)


def _folder(tmp_path, **config):
    import json

    path = tmp_path / "m"
    path.mkdir()
    base = dict(model_type="olmoe", hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=256)
    (path / "config.json").write_text(json.dumps({**base, **config}))
    return path  # no weights: every refusal below must come before any are read


@pytest.mark.parametrize("config, recipe, overrides, msg", [
    ({"model_type": "gpt2"}, "awq4", {}, "AWQ smoothing .* does not handle model_type 'gpt2'.*supported: llama"),
    ({}, "gptq4", {"kv_heads": 2}, "KV-head conversion .* does not handle model_type 'olmoe'"),
    ({"model_type": "gemma2"}, "rtn4", {"rotate": "hadamard"}, "rotation folding .* 'gemma2'"),
    ({"auto_map": {"AutoModelForCausalLM": "m.M"}, "model_type": "mine"}, "rtn4", {}, "--trust-remote-code"),
    ({"model_type": "not_a_model"}, "rtn4", {}, "'not_a_model' .* unknown to this transformers"),
    ({"num_attention_heads": None}, "rtn4", {}, "lacks num_attention_heads"),
    ({"model_type": "llama", "rope_scaling": {"rope_type": "llama3", "factor": 32.0}}, "rtn4", {},
     "rope_type 'llama3' without low_freq_factor, high_freq_factor, original_max_position_embeddings"),
])
def test_a_family_a_step_cannot_handle_is_refused_before_loading(tmp_path, config, recipe, overrides, msg):
    with pytest.raises(ValueError, match=msg):
        compress.quantize(str(_folder(tmp_path, **config)), recipe=recipe, out=tmp_path / "q", **overrides)
    assert not (tmp_path / "q").exists()


LLAMA3_WITHOUT_FACTORS = {"model_type": "llama", "rope_scaling": {"rope_type": "llama3", "factor": 8.0,
                                                                  "original_max_position_embeddings": 8192}}


def test_export_and_serve_name_a_missing_rope_field_before_loading(tmp_path):
    from runtime.models.loader import open_checkpoint

    folder = _folder(tmp_path, **LLAMA3_WITHOUT_FACTORS)
    with pytest.raises(ValueError, match="'llama3' without low_freq_factor, high_freq_factor \\(model_type 'llama'"):
        compress.export(str(folder), "onnx", tmp_path / "x")
    assert not (tmp_path / "x").exists()
    with pytest.raises(ValueError, match="'llama3' without low_freq_factor"):
        open_checkpoint(str(folder))


def test_rope_fields_per_layer_type_and_top_level_original_positions():
    from compress.format.families import check_rope

    check_rope({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0}, "original_max_position_embeddings": 8192})
    with pytest.raises(ValueError, match="rope_type 'linear' without factor"):
        check_rope({"rope_parameters": {"full_attention": {"rope_type": "linear"},
                                        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}})
