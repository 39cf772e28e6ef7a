"""Quantized embedding and LM head (issue 32's checkpoint format) through the export formats: GGUF writes
``token_embd``/``output`` from our codes; the other formats carry the head as a quantized linear and the embedding
dequantized; every exported tensor is checked against the checkpoint's own dequantized reference."""
from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import torch

from compress.exporters.common import read_tables
from compress.exporters.dispatch import export
from compress.exporters.gguf import GGUFOptions
from compress.format.quant import Scheme

from .gguf_models import build
from .tables import with_tables

gguf = pytest.importorskip("gguf")
BODY = Scheme(4, 32, True)


@pytest.fixture(scope="module")
def tabled(tmp_path_factory):
    """tabled(family, embed, head) -> a tiny checkpoint (GGUF test tokenizer) with those tables quantized."""
    bodies, cache = {}, {}

    def make(family: str, embed: Scheme | None, head: Scheme | None):
        key = (family, embed, head)
        if key not in cache:
            if family not in bodies:
                bodies[family] = build(tmp_path_factory.mktemp("body") / family, family, BODY)
            cache[key] = with_tables(bodies[family], tmp_path_factory.mktemp("tab") / "q", embed, head)
        return cache[key]

    return make


def _reader(path):
    r = gguf.GGUFReader(path)
    return {t.name: t for t in r.tensors}


def _deq(t) -> np.ndarray:
    return gguf.quants.dequantize(t.data, t.tensor_type).reshape(tuple(int(x) for x in reversed(t.shape)))


def _reference(src, which: str) -> torch.Tensor:
    tables = read_tables(src, 64)
    return getattr(tables, which).weight.dequantize()


def _q4_1_tolerance(src, which: str) -> float:
    """Q4_1 stores ``m = -scale * zero`` rounded to fp16: the only difference from our values."""
    qw = getattr(read_tables(src, 64), which).weight
    m = qw.scale.float() * qw.zero.float()
    return float((m - m.half().float()).abs().max()) + 1e-7


@pytest.mark.parametrize("family,embed,head,types", [
    ("llama", Scheme(8, 32, True), Scheme(4, 32, True), ("Q8_0", "Q4_0")),  # untied
    ("qwen2", Scheme(4, 32, False), Scheme(8, 64, True), ("Q4_1", "Q8_0")),  # a group of 64: blocks repeat scales
    ("gemma", Scheme(4, 32, True), None, ("Q4_0", None)),  # tied: one tensor, no output
])
def test_gguf_writes_embedding_and_head_from_our_codes(tabled, tmp_path, family, embed, head, types):
    src = tabled(family, embed, head)
    tensors = _reader(export(str(src), "gguf", tmp_path / "m.gguf"))
    for name, which, qtype in (("token_embd.weight", "embed", types[0]), ("output.weight", "head", types[1])):
        if qtype is None:
            assert name not in tensors  # llama.cpp reads token_embd for a tied head
            continue
        assert tensors[name].tensor_type.name == qtype, name
        got, want = _deq(tensors[name]), _reference(src, which).numpy()
        if qtype == "Q4_1":
            np.testing.assert_allclose(got, want, rtol=0, atol=_q4_1_tolerance(src, which))
        else:
            np.testing.assert_array_equal(got, want, err_msg=name)


def test_gguf_rounds_again_what_does_not_map_and_says_so(tabled, tmp_path, caplog):
    """8-bit asymmetric codes have no block type: requantized to Q8_0 from the dequantized weights, logged."""
    src = tabled("llama", Scheme(8, 32, False), None)
    with caplog.at_level(logging.WARNING, logger="compress.exporters.gguf"):
        path = export(str(src), "gguf", tmp_path / "m.gguf")
    assert "model.embed_tokens" in caplog.text and "Q8_0" in caplog.text and "not lossless" in caplog.text
    reader = gguf.GGUFReader(path)
    t = next(t for t in reader.tensors if t.name == "token_embd.weight")
    assert t.tensor_type.name == "Q8_0"
    want = _reference(src, "embed")
    step = want.reshape(want.shape[0], -1, 32).abs().amax(-1, keepdim=True) / 127  # Q8_0's step per block
    err = (torch.from_numpy(_deq(t).copy()).reshape_as(step.expand(-1, -1, 32)) - want.reshape(step.shape[0], -1, 32))
    assert bool((err.abs() <= 0.6 * step).all())  # half a step, plus d's rounding to fp16 (127 * 2**-11 steps)
    fields = {k: f.contents() for k, f in reader.fields.items()}
    assert fields["compress.lossless"] is False and "token_embd.weight" in fields["compress.requantized"]


def test_gguf_head_that_does_not_map_is_not_refused(tabled, tmp_path):
    """A quantized head is listed in ``modules`` like any linear, but GGUF never refuses the tables."""
    src = tabled("llama", None, Scheme(4, -1, False, "nf4"))
    tensors = _reader(export(str(src), "gguf", tmp_path / "m.gguf"))
    assert tensors["output.weight"].tensor_type.name == "Q4_1"
    assert tensors["token_embd.weight"].tensor_type.name == "F16"  # an fp embedding follows --dtype, as before
    with pytest.raises(ValueError, match="requantize"):  # the body's own layers are still refused as before
        export(str(src), "gguf", tmp_path / "k.gguf", options=GGUFOptions(requantize="q9"))


@pytest.fixture(scope="module")
def small(tmp_path_factory, quantized_dir):
    """small(family, embed, head) -> the shared export fixtures' tiny checkpoint (4-bit sym, group 32) with tables."""
    cache = {}

    def make(family: str, embed: Scheme | None, head: Scheme | None):
        key = (family, embed, head)
        if key not in cache:
            src = quantized_dir(family=family, bits=4, group=32, sym=True)
            cache[key] = with_tables(src, tmp_path_factory.mktemp("tab") / "q", embed, head)
        return cache[key]

    return make


UNTIED = ("llama", Scheme(8, 32, True), Scheme(4, 32, True))
TIED = ("gemma", Scheme(4, 32, False), None)


@pytest.mark.parametrize("case", [UNTIED, TIED], ids=["untied", "tied"])
def test_gptq_carries_the_head_as_a_quantized_layer_and_the_embedding_dequantized(small, tmp_path, case):
    from safetensors.torch import load_file

    from .test_gptq import reference_dequantize

    src = small(*case)
    out = export(str(src), "gptq", tmp_path / "g", dtype="float32", dequantize_embedding=True)
    tensors = load_file(str(out / "model.safetensors"))
    qc = json.loads((out / "quantize_config.json").read_text())
    assert torch.equal(tensors["model.embed_tokens.weight"], _reference(src, "embed"))
    assert "model.embed_tokens.qweight" not in tensors
    if case is TIED:
        assert not any(k.startswith("lm_head") for k in tensors) and not qc["lm_head"]
        assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True
        return
    assert qc["lm_head"] is True
    got = reference_dequantize(tensors["lm_head.qweight"], tensors["lm_head.qzeros"], tensors["lm_head.scales"],
                               tensors["lm_head.g_idx"], 4, offset=1 if qc["checkpoint_format"] == "gptq" else 0)
    assert torch.equal(got, _reference(src, "head"))


def test_awq_carries_the_head_as_a_quantized_layer(small, tmp_path):
    from safetensors.torch import load_file

    from .test_awq import reference_dequantize

    src = small(*UNTIED)
    out = export(str(src), "awq", tmp_path / "a", dtype="float32", dequantize_embedding=True)
    tensors = load_file(str(out / "model.safetensors"))
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["modules_to_not_convert"] is None and qc["lm_head"] is True
    got = reference_dequantize(tensors["lm_head.qweight"], tensors["lm_head.qzeros"], tensors["lm_head.scales"], 32)
    assert torch.equal(got, _reference(src, "head"))
    assert torch.equal(tensors["model.embed_tokens.weight"], _reference(src, "embed"))


@pytest.mark.parametrize("case", [UNTIED, TIED], ids=["untied", "tied"])
def test_compressed_tensors_quantized_head_loads_in_transformers_with_our_logits(small, tmp_path, case):
    """The head is a config-group target (by name, so vLLM's ParallelLMHead matches it too); the library
    decompresses it to our values, and transformers' logits equal the checkpoint's."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.pack_quantized import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from compress.format.checkpoint import load_quantized

    src = small(*case)
    out = export(str(src), "compressed-tensors", tmp_path / "c", dtype="float32", dequantize_embedding=True)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    tensors = load_file(str(out / "model.safetensors"))
    assert torch.equal(tensors["model.embed_tokens.weight"], _reference(src, "embed"))
    if case is UNTIED:
        assert "lm_head" not in qc["ignore"]
        cfg = QuantizationConfig.model_validate(qc)
        (group,) = [g for g in cfg.config_groups.values() if "re:^lm_head$" in g.targets]
        local = {k.removeprefix("lm_head."): v for k, v in tensors.items() if k.startswith("lm_head.")}
        got = PackedQuantizationCompressor.decompress(local, group)["weight"]
        assert torch.equal(got, _reference(src, "head"))
    theirs = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ours = load_quantized(src)
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(theirs(ids).logits, ours(ids).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", [UNTIED, TIED], ids=["untied", "tied"])
def test_onnx_int4_runs_the_embedding_and_head_from_our_codes(small, tmp_path, case):
    """The embedding is com.microsoft::GatherBlockQuantized on our codes; the head (untied, or tied at 4 bits)
    MatMulNBits; ONNX Runtime's logits equal the checkpoint's."""
    onnx = pytest.importorskip("onnx")
    pytest.importorskip("onnxruntime")
    from compress.exporters.onnx_runner import OnnxCausalLM
    from compress.format.checkpoint import load_quantized, quantized_modules

    src = small(*case)
    out = export(str(src), "onnx-int4", tmp_path / "o")
    graph = onnx.load(str(out / "model.onnx"), load_external_data=False)
    ours = load_quantized(src)
    nbits = [n for n in graph.graph.node if n.op_type == "MatMulNBits"]
    assert len(nbits) == 15 and len(quantized_modules(ours)) == 14 + (case is UNTIED)  # a tied 4-bit head reads the
    inits = {i.name for i in graph.graph.initializer}  # embedding's codes; no fp copy of either table is left
    assert "model.lm_head.b" in inits and "model.lm_head.weight" not in inits
    gathers = [n for n in graph.graph.node if n.op_type == "GatherBlockQuantized"]
    assert len(gathers) == 1 and gathers[0].domain == "com.microsoft"
    assert not any(i.endswith("embed_tokens.weight") for i in inits)
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = ours(ids).logits
    got = OnnxCausalLM(out)(ids).logits
    assert float((got - ref).abs().max() / ref.abs().max()) <= 1e-3


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """wide(family) -> a 4-bit checkpoint of hidden 256 (whole Q6_K super-blocks) with an fp embedding and head."""
    cache = {}

    def make(family: str):
        if family not in cache:
            cache[family] = build(tmp_path_factory.mktemp("wide") / family, family, BODY, hidden=256)
        return cache[family]

    return make


@pytest.mark.parametrize("family,head", [("llama", "output.weight"), ("gemma", "token_embd.weight")])
def test_gguf_fp_head_of_a_quantized_model_defaults_to_q6_k(wide, tmp_path, family, head):
    """As llama.cpp's Q4_K_M: ``output`` (a tied model's ``token_embd``) as Q6_K; an untied embedding keeps
    --embed-type's default; the Q6_K values are within a step of the fp head, as llama.cpp's own rounding."""
    from compress.format.checkpoint import load_quantized

    src = wide(family)
    tensors = _reader(export(str(src), "gguf", tmp_path / "m.gguf"))
    assert tensors[head].tensor_type.name == "Q6_K"
    if family == "llama":
        assert tensors["token_embd.weight"].tensor_type.name == "F16" and "output.weight" in tensors
    else:
        assert "output.weight" not in tensors
    w = load_quantized(src).get_output_embeddings().weight.detach().reshape(-1, 16, 16)  # [super-blocks, 16, 16]
    got = torch.from_numpy(_deq(tensors[head]).copy()).reshape(w.shape)
    step = w.abs().amax(-1, keepdim=True) / 32
    top = step.amax(-2, keepdim=True)
    assert bool(((got - w).abs() <= step + 17 * top / 128).all())


@pytest.mark.parametrize("options,want", [
    (dict(output_type="f16"), "F16"), (dict(embed_type="f32"), "F32"),  # --embed-type alone: the head follows it
    ({}, "Q8_0"),  # width 64 is no whole super-block: Q6_K falls back to Q8_0 as in llama.cpp
])
def test_gguf_output_type_option(tabled, tmp_path, options, want):
    src = tabled("llama", None, None)
    tensors = _reader(export(str(src), "gguf", tmp_path / "m.gguf", options=GGUFOptions(**options)))
    assert tensors["output.weight"].tensor_type.name == want


@pytest.mark.parametrize("scheme,block", [
    (Scheme(4, 32, False), 32), (Scheme(8, 64, False), 64), (Scheme(8, -1, True), 64), (Scheme(4, 16, True), 16),
    (Scheme(4, -1, False), None),  # one 4-bit block a row: zero points pack two blocks a byte
    (Scheme(3, 32, False), None), (Scheme(4, 32, True, "nf4"), None), (Scheme(4, 24, False), None),
])
def test_gather_block_quantized_reference_equals_our_dequantized_rows(scheme, block):
    """The module's eager path (GatherBlockQuantized's math) gives the checkpoint's rows, or the scheme is left to
    the dequantized table."""
    from compress.exporters.onnx_int4 import GatherQuantizedEmbedding, gather_block
    from compress.format.quant import QuantizedWeight, compute_qparams, quantize

    w = torch.randn(40, 64, generator=torch.Generator().manual_seed(0))
    scale, zero = compute_qparams(w, scheme)
    qw = QuantizedWeight(quantize(w, scale, zero, scheme), scale, zero, scheme)
    assert gather_block(qw) == block
    if block is None:
        return
    ids = torch.tensor([[0, 39, 7], [3, 3, 12]])
    got = GatherQuantizedEmbedding(qw)(ids)
    assert torch.equal(got, qw.dequantize()[ids])


@pytest.mark.parametrize("family,embed,head", [("llama", Scheme(8, 32, True), Scheme(4, 32, True)),
                                               ("qwen2", Scheme(4, 32, True), Scheme(8, 32, True))])
def test_gguf_with_quantized_tables_reads_back_as_the_checkpoints_model(tabled, tmp_path, family, embed, head):
    """Through compress's own GGUF reader (transformers' name maps; it has no Gemma, so no tied case here): the
    logits of the checkpoint itself, every table being exact (Q8_0/Q4_0)."""
    from transformers import AutoModelForCausalLM

    from compress.format import gguf_dequant
    from compress.format.checkpoint import load_quantized

    src = tabled(family, embed, head)
    path = export(str(src), "gguf", tmp_path / "m.gguf", options=GGUFOptions(embed_type="f32"))
    out = tmp_path / "fp"
    out.mkdir()
    gguf_dequant.dequantize_gguf(path.parent, path.name, out)
    ids = torch.arange(1, 13)[None]
    with torch.no_grad():
        got = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)(ids).logits
        want = load_quantized(src)(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_a_head_the_format_cannot_carry_is_refused_naming_the_flag(tabled, tmp_path):
    """AWQ packs 8 outputs a word: a 300-row head is refused before any work, naming --head none."""
    src = tabled("llama", None, Scheme(4, 32, True))
    with pytest.raises(ValueError, match="awq cannot carry lm_head") as e:
        export(str(src), "awq", tmp_path / "a")
    assert "--head none" in str(e.value) and not (tmp_path / "a").exists()


@pytest.mark.parametrize("fmt", ["compressed-tensors", "gptq", "awq"])
def test_an_embedding_the_format_cannot_carry_is_refused_naming_the_flag(small, tmp_path, fmt):
    """Written dequantized, the table would silently make the export the fp model's size: refused, naming
    --dequantize-embedding and --embed none, and nothing written."""
    src = small(*TIED)
    with pytest.raises(ValueError, match=f"--format {fmt} cannot carry the quantized embedding") as e:
        export(str(src), fmt, tmp_path / "x")
    assert "--dequantize-embedding" in str(e.value) and "--embed none" in str(e.value)
    assert not (tmp_path / "x").exists()


def test_onnx_int4_refuses_an_embedding_gather_block_quantized_cannot_take(small, tmp_path):
    src = small("llama", Scheme(4, 32, True, "nf4"), None)
    with pytest.raises(ValueError, match="onnx-int4 cannot carry the quantized embedding .*GatherBlockQuantized"):
        export(str(src), "onnx-int4", tmp_path / "o")
    assert not (tmp_path / "o").exists()
