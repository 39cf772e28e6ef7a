"""`--format gguf`: metadata, tokenizer and every tensor read back with the gguf package, for tiny dense and MoE
models; refusals that name the fix; --requantize; single-file atomicity and --overwrite."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from compress.exporters.dispatch import export
from compress.exporters.gguf import GGUFOptions
from compress.format.checkpoint import load_quantized
from compress.format.quant import Scheme

from .gguf_models import CHAT_TEMPLATE, DENSE, MOE, VOCAB, build, rope_interleave

gguf = pytest.importorskip("gguf")
ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma": "gemma", "mixtral": "llama",
        "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe"}
ROPE_PERMUTED = ("llama", "mistral", "mixtral")  # llama.cpp runs these with NORM rope


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """checkpoint(family, bits=4, group=32, sym=True, act_order=False) -> quantized folder, built once."""
    cache = {}

    def make(family: str, bits: int = 4, group: int = 32, sym: bool = True, act_order: bool = False, fmt="int"):
        key = (family, bits, group, sym, act_order, fmt)
        if key not in cache:
            folder = tmp_path_factory.mktemp("gq") / "-".join(map(str, key))
            cache[key] = build(folder, family, Scheme(bits, group, sym, fmt), act_order)
        return cache[key]

    return make


def _export(src, out, **options):
    return export(str(src), "gguf", out, options=GGUFOptions(**options) if options else None)


def _fields(reader) -> dict:
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def _tensor(reader, name: str) -> np.ndarray:
    """A tensor dequantized by the gguf package, in numpy's [..., out, in] order."""
    t = next(t for t in reader.tensors if t.name == name)
    return gguf.quants.dequantize(t.data, t.tensor_type).reshape(tuple(int(x) for x in reversed(t.shape)))


def _type(reader, name: str) -> str:
    return next(t.tensor_type.name for t in reader.tensors if t.name == name)


def _expected_linears(model, family: str) -> dict[str, torch.Tensor]:
    """GGUF name -> the checkpoint's dequantized weight, for a few linears and (for MoE) the packed experts."""
    cfg, layer = model.config, model.model.layers[1]
    attn = layer.self_attn
    out = {"blk.1.attn_q.weight": attn.q_proj.dequantized_weight(), "blk.1.attn_k.weight": attn.k_proj.dequantized_weight(),
           "blk.1.attn_v.weight": attn.v_proj.dequantized_weight(), "blk.1.attn_output.weight": attn.o_proj.dequantized_weight()}
    if family in ROPE_PERMUTED:
        out["blk.1.attn_q.weight"] = rope_interleave(out["blk.1.attn_q.weight"], cfg.num_attention_heads)
        out["blk.1.attn_k.weight"] = rope_interleave(out["blk.1.attn_k.weight"], cfg.num_key_value_heads)
    if family in MOE:
        ex = layer.mlp.experts
        gate_up = torch.stack([ex.gate_up_proj.expert_weight(e) for e in range(ex.num_experts)])
        out["blk.1.ffn_gate_exps.weight"], out["blk.1.ffn_up_exps.weight"] = gate_up.chunk(2, dim=1)
        out["blk.1.ffn_down_exps.weight"] = torch.stack([ex.down_proj.expert_weight(e) for e in range(ex.num_experts)])
    else:
        out["blk.1.ffn_down.weight"] = layer.mlp.down_proj.dequantized_weight()
    return out


@pytest.mark.parametrize("family", DENSE + MOE)
def test_metadata_tokenizer_and_tensors_read_back(checkpoint, family, tmp_path):
    src = checkpoint(family)
    path = _export(src, tmp_path / "m.gguf", embed_type="f32")
    reader = gguf.GGUFReader(path)
    f = _fields(reader)
    model = load_quantized(src)
    cfg, arch = model.config, ARCH[family]
    assert f["general.architecture"] == arch
    assert f[f"{arch}.block_count"] == 2 and f[f"{arch}.embedding_length"] == cfg.hidden_size
    assert f[f"{arch}.attention.head_count"] == 4 and f[f"{arch}.attention.head_count_kv"] == 2
    assert f[f"{arch}.attention.key_length"] == (getattr(cfg, "head_dim", None) or cfg.hidden_size // 4)
    assert f[f"{arch}.rope.freq_base"] == pytest.approx(cfg.rope_parameters["rope_theta"])
    if family in MOE:
        assert f[f"{arch}.expert_count"] == 4 and f[f"{arch}.expert_used_count"] == 2
    # tokenizer: every id, its type, the merges, the special ids and the chat template
    from compress.format.models import load_model

    tok = load_model(str(src))[1]  # what transformers makes of the saved tokenizer for this family
    tokens = f["tokenizer.ggml.tokens"]
    assert len(tokens) == VOCAB and tokens[:290] == tok.convert_ids_to_tokens(list(range(290)))
    assert tokens[295] == "[PAD295]" and f["tokenizer.ggml.token_type"][295] == 5
    assert f["tokenizer.ggml.token_type"][tok.convert_tokens_to_ids("<|im_end|>")] == 3
    assert f["tokenizer.ggml.model"] == "gpt2"
    assert f["tokenizer.ggml.pre"] == ("qwen2" if family == "qwen2" else "gpt-2"), type(tok)
    merges = json.loads(tok.backend_tokenizer.to_str())["model"]["merges"]
    assert f["tokenizer.ggml.merges"] == [" ".join(m) for m in merges] and len(merges) > 0
    assert f["tokenizer.ggml.bos_token_id"] == tok.bos_token_id and f["tokenizer.ggml.eos_token_id"] == tok.eos_token_id
    assert f["tokenizer.chat_template"] == CHAT_TEMPLATE
    # provenance
    assert f["compress.quant_method"] == "rtn" and f["compress.recipe"] == "test" and f["compress.lossless"] is True
    assert '"group_size": 32' in f["compress.scheme"]
    assert f["general.file_type"] == 2  # mostly Q4_0
    # tensors: quantized linears are Q4_0 and dequantize bit-identically to ours (after llama's q/k rows)
    for name, want in _expected_linears(model, family).items():
        assert _type(reader, name) == "Q4_0", name
        np.testing.assert_array_equal(_tensor(reader, name), want.numpy(), err_msg=name)
    # fp tensors: F32 norms (Gemma's stored as 1 + w, as llama.cpp multiplies by the weight directly)
    norm = model.model.norm.weight.detach() + (1.0 if family == "gemma" else 0.0)
    assert _type(reader, "output_norm.weight") == "F32"
    np.testing.assert_array_equal(_tensor(reader, "output_norm.weight"), norm.numpy())
    np.testing.assert_array_equal(_tensor(reader, "token_embd.weight"), model.model.embed_tokens.weight.detach().numpy())
    names = {t.name for t in reader.tensors}
    assert ("output.weight" in names) == (not cfg.tie_word_embeddings)
    if family in ("qwen2", "qwen2_moe"):
        assert "blk.0.attn_q.bias" in names
    if family == "qwen2_moe":
        assert _tensor(reader, "blk.0.ffn_gate_inp_shexp.weight").shape == (cfg.hidden_size,)
    if family in ("qwen3", "qwen3_moe"):
        assert "blk.0.attn_q_norm.weight" in names and "blk.0.attn_k_norm.weight" in names


@pytest.mark.parametrize("bits,sym,group,qtype", [(4, False, 32, "Q4_1"), (8, True, 32, "Q8_0"), (4, True, 64, "Q4_0"),
                                                  (8, True, -1, "Q8_0")])
def test_other_schemes_map_exactly(checkpoint, tmp_path, bits, sym, group, qtype):
    """Q4_1 within fp16 rounding of m; Q8_0 and groups of any multiple of 32 (each block repeats its group's
    scale) bit-identical."""
    src = checkpoint("qwen2", bits=bits, group=group, sym=sym)
    reader = gguf.GGUFReader(_export(src, tmp_path / "m.gguf"))
    model = load_quantized(src)
    down = model.model.layers[0].mlp.down_proj
    got, want = _tensor(reader, "blk.0.ffn_down.weight"), down.dequantized_weight().numpy()
    assert _type(reader, "blk.0.ffn_down.weight") == qtype
    if qtype == "Q4_1":
        m = (down.scales.float() * down.qzeros.float()).repeat_interleave(32, dim=1).numpy()
        assert (np.abs(got - want) <= np.abs(m) * 2**-11 + 1e-7).all()
    else:
        np.testing.assert_array_equal(got, want)
    assert _type(reader, "token_embd.weight") == "F16"  # the default --embed-type follows --dtype float16


@pytest.mark.parametrize("recipe,fix", [
    (dict(group=16), "--group-size 32"),
    (dict(bits=3, sym=False), "3-bit asymmetric codes have no GGUF block type"),
    (dict(bits=8, sym=False), "--sym"),
    (dict(act_order=True), "--no-act-order"),
    (dict(fmt="nf4"), "nf4 codes have no GGUF block type"),
])
def test_layers_that_do_not_map_are_refused_before_writing(checkpoint, tmp_path, recipe, fix):
    with pytest.raises(ValueError, match="--format gguf cannot carry") as e:
        _export(checkpoint("llama", **recipe), tmp_path / "m.gguf")
    assert fix in str(e.value) and "--requantize" in str(e.value)
    assert list(tmp_path.iterdir()) == []


def test_requantize_rounds_again_by_llama_cpp_rules_and_says_so(checkpoint, tmp_path, caplog):
    src = checkpoint("llama", group=16)
    with caplog.at_level("WARNING"):
        reader = gguf.GGUFReader(_export(src, tmp_path / "m.gguf", requantize="q4_0"))
    assert "requantized 14 tensor(s) to q4_0" in caplog.text
    f = _fields(reader)
    assert f["compress.lossless"] is False and f["compress.requantize_type"] == "q4_0"
    assert "blk.0.attn_v.weight" in f["compress.requantized"] and len(f["compress.requantized"]) == 14
    v = load_quantized(src).model.layers[0].self_attn.v_proj.dequantized_weight().numpy()
    want = gguf.quants.dequantize(gguf.quants.quantize(v, gguf.GGMLQuantizationType.Q4_0), gguf.GGMLQuantizationType.Q4_0)
    np.testing.assert_array_equal(_tensor(reader, "blk.0.attn_v.weight"), want)


def test_unsupported_architecture_is_refused_naming_the_supported(tmp_path, monkeypatch, checkpoint):
    import dataclasses

    from compress.format import families

    monkeypatch.setitem(families.FAMILIES, "llama", dataclasses.replace(families.FAMILIES["llama"], gguf=None))
    with pytest.raises(ValueError, match="does not handle model_type 'llama'; supported: mistral"):
        _export(checkpoint("llama"), tmp_path / "m.gguf")
    assert list(tmp_path.iterdir()) == []


def test_one_file_kept_unless_overwrite_and_never_half_written(checkpoint, tmp_path, monkeypatch):
    from compress.exporters import gguf as gguf_export

    src, out = checkpoint("llama"), tmp_path / "m.gguf"
    _export(src, out)
    first = out.read_bytes()
    with pytest.raises(FileExistsError, match="--overwrite"):
        _export(src, out)
    assert out.read_bytes() == first
    with pytest.raises(ValueError, match="ending in .gguf"):
        _export(src, tmp_path / "folder")

    def broken(source, path, dtype, options):
        path.write_bytes(b"GGUF half")
        raise ValueError("disk full")

    monkeypatch.setattr(gguf_export, "write", broken)
    with pytest.raises(ValueError, match="disk full"):
        export(str(src), "gguf", out, overwrite=True)
    assert out.read_bytes() == first and [p.name for p in tmp_path.iterdir()] == ["m.gguf"]
    monkeypatch.undo()
    export(str(src), "gguf", out, overwrite=True, options=GGUFOptions(embed_type="q8_0"))
    assert out.read_bytes() != first and _type(gguf.GGUFReader(out), "token_embd.weight") == "Q8_0"


def test_cli_gguf_flags(checkpoint, tmp_path):
    from click.testing import CliRunner

    from cli import main

    src = str(checkpoint("llama"))
    r = CliRunner().invoke(main, ["export", src, "--format", "gguf", "--out", str(tmp_path / "m.gguf")])
    assert r.exit_code == 0 and (tmp_path / "m.gguf").is_file(), r.output
    r = CliRunner().invoke(main, ["export", src, "--format", "gptq", "--out", str(tmp_path / "g"), "--requantize", "q4_0"])
    assert r.exit_code == 2 and "apply to --format gguf" in r.output
    r = CliRunner().invoke(main, ["export", src, "--format", "gguf", "--out", str(tmp_path / "x.gguf"),
                                  "--embed-type", "f8"])
    assert r.exit_code == 2 and "--embed-type 'f8'" in r.output and not (tmp_path / "x.gguf").exists()


def test_recipes_say_which_gguf_type_they_export_to_losslessly():
    from click.testing import CliRunner

    from cli import main

    lines = {line.split()[0]: line for line in CliRunner().invoke(main, ["recipes"]).output.splitlines()}
    assert lines["gptq4-q4_0"].endswith("[gguf Q4_0]") and lines["awq4-q4_1"].endswith("[gguf Q4_1]")
    assert lines["int8"].endswith("[gguf Q8_0]") and lines["gptq3"].endswith("[gguf needs --requantize]")


def test_act_order_folds_when_every_block_lies_in_one_group():
    from compress.exporters.gguf import encode_exact, why_not
    from compress.format.quant import QuantizedWeight, compute_qparams, quantize

    s = Scheme(4, 32, sym=True)
    w = torch.randn(6, 128, generator=torch.Generator().manual_seed(0))
    g_idx = torch.tensor([2, 0, 3, 1]).repeat_interleave(32)  # whole blocks, groups out of order
    perm = torch.argsort(g_idx, stable=True)
    scale, _ = compute_qparams(w[:, perm], s)
    qw = QuantizedWeight(quantize(w, scale, None, s, g_idx), scale, None, s, g_idx)
    assert why_not(s, 128, g_idx) is None and "--no-act-order" in why_not(s, 128, g_idx.roll(1))
    got = gguf.quants.dequantize(encode_exact(qw).data.numpy(), gguf.GGMLQuantizationType.Q4_0).reshape(6, 128)
    np.testing.assert_array_equal(got, qw.dequantize().numpy())


@pytest.mark.parametrize("sym", [True, False])
def test_k_quants_keep_the_codes_where_widths_divide_by_256_and_fall_back_elsewhere(tmp_path, sym):
    src = build(tmp_path / "q", "qwen2", Scheme(4, 32, sym), hidden=256)  # intermediate 128: down_proj falls back
    reader = gguf.GGUFReader(_export(src, tmp_path / "m.gguf", k_quants=True))
    f = _fields(reader)
    assert _type(reader, "blk.0.attn_q.weight") == "Q4_K" and _type(reader, "blk.0.ffn_up.weight") == "Q4_K"
    assert _type(reader, "blk.0.ffn_down.weight") == ("Q4_0" if sym else "Q4_1")
    assert f["general.file_type"] == 14 and f["compress.lossless"] is False and f["compress.k_quants"] == 12
    up = load_quantized(src).model.layers[0].mlp.up_proj
    want = up.dequantized_weight().numpy()
    got = _tensor(reader, "blk.0.ffn_up.weight")
    # the codes are ours; only the 6-bit rounding moves the weights: half a 6-bit step of the scale per code
    # step (15 at most) plus half a step of the min (at most 15 scales): 30/126 of the super-block's top scale
    top = up.scales.float().reshape(up.out_features, -1, 8).amax(-1).repeat_interleave(256, dim=1).numpy()
    assert (np.abs(got - want) <= top * (15 + 15) / 126 + 1e-6).all()
    assert np.abs(got - want).mean() < 0.05 * np.abs(want).mean()


NEW = {  # family -> llama.cpp's tensors of one block, and metadata its graph reads
    "granite": ({"attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up",
                 "ffn_down"},
                {"logit_scale": 4.0, "embedding_scale": 6.0, "residual_scale": 0.5, "attention.scale": 0.2}),
    "phi3": ({"attn_norm", "attn_qkv", "attn_output", "ffn_norm", "ffn_up", "ffn_down"}, {"rope.dimension_count": 8}),
    "olmo2": ({"attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm", "attn_k_norm", "post_attention_norm",
               "ffn_gate", "ffn_up", "ffn_down", "post_ffw_norm"}, {}),
    "gemma2": ({"attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "post_attention_norm", "ffn_norm",
                "ffn_gate", "ffn_up", "ffn_down", "post_ffw_norm"},
               {"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, "attention.sliding_window": 8}),
    "gemma3_text": ({"attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm", "attn_k_norm",
                     "post_attention_norm", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down", "post_ffw_norm"},
                    {"attention.sliding_window_pattern": [True, False], "rope.freq_base": 1e6,
                     "rope.freq_base_swa": 1e4, "rope.scaling.type": "linear", "rope.scaling.factor": 2.0}),
}


@pytest.mark.parametrize("family", NEW)
def test_newer_families_carry_llama_cpps_names_and_metadata(checkpoint, family, tmp_path):
    """llama.cpp itself loads and runs these (test_gguf_llamacpp.py); here: the names and keys it reads."""
    from compress.format.families import FAMILIES

    reader = gguf.GGUFReader(_export(checkpoint(family), tmp_path / "m.gguf"))
    arch = FAMILIES[family].gguf.name
    f = _fields(reader)
    assert f["general.architecture"] == arch
    blocks, keys = NEW[family]
    assert {t.name.split(".")[2] for t in reader.tensors if t.name.startswith("blk.0.")} == blocks
    for key, value in keys.items():
        assert f[f"{arch}.{key}"] == (value if isinstance(value, (str, list)) else pytest.approx(value)), key
    if FAMILIES[family].norm_offset:  # Gemma's post-norms and q/k norms are stored as 1 + w too
        model = load_quantized(checkpoint(family))
        np.testing.assert_array_equal(_tensor(reader, "blk.0.post_ffw_norm.weight"),
                                      model.model.layers[0].post_feedforward_layernorm.weight.detach().numpy() + 1)
