"""Issue 32's acceptance: a quantized embedding and LM head round-trip through every format, on a tiny model of every
family, tied and untied. Each checkpoint is made as `compress quantize` makes it (rtn4 body, int8 embedding and int4
head untied, one int4 table tied); every exported table is compared with the dequantized reference computed here
from the fp model by RTN, and the formats a family cannot take refuse it. The ONNX runs trace the whole model
(seconds each) and are marked slow."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from tiny_models import FAMILIES, MOE_FAMILIES, one_thread, tiny_model

from compress.config import load_recipe
from compress.exporters.dispatch import export
from compress.format.checkpoint import load_quantized
from compress.format.families import supports
from compress.format.quant import quantize_weight
from compress.job import quantize_to_folder
from compress.methods.embed_head import OUTER_SCHEMES

from .gguf_models import bpe_tokenizer
from .test_awq import reference_dequantize as awq_dequantize
from .test_gptq import reference_dequantize as gptq_dequantize

gguf = pytest.importorskip("gguf")
VOCAB = 304  # the BPE fills 290 ids; a multiple of 8, so AWQ can pack the head's rows
TABLES = {False: ("int8", "int4"), True: ("int4", "int4")}  # tied -> (embed, head)
CASES = [(f, t) for f in (*FAMILIES, *MOE_FAMILIES) for t in (False, True)]
IDS = torch.randint(0, 290, (2, 11), generator=torch.Generator().manual_seed(1))


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with one_thread():
        yield


class Case:
    """One family's checkpoint with quantized tables, and the tables' dequantized references."""

    def __init__(self, root: Path, family: str, tied: bool):
        self.family, self.tied = family, tied
        fp = tiny_model(family, vocab=VOCAB, hidden=128 if family in MOE_FAMILIES else 64, tie=tied)
        assert bool(fp.config.tie_word_embeddings) == tied
        fp.save_pretrained(root / "fp")
        bpe_tokenizer().save_pretrained(root / "fp")
        embed, head = TABLES[tied]
        cfg = load_recipe("rtn4").replace(group_size=32, embed=embed, head=head)
        self.out = Path(quantize_to_folder(str(root / "fp"), cfg, str(root / "q")).out)
        self.embed_name = next(n for n, m in fp.named_modules() if m is fp.get_input_embeddings())
        self.embed = quantize_weight(fp.get_input_embeddings().weight.data, OUTER_SCHEMES[embed]).dequantize()
        self.head = self.embed if tied else quantize_weight(fp.lm_head.weight.data, OUTER_SCHEMES[head]).dequantize()


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    cache = {}

    def make(family: str, tied: bool) -> Case:
        if (family, tied) not in cache:
            cache[family, tied] = Case(tmp_path_factory.mktemp(f"{family}-{tied}"), family, tied)
        return cache[family, tied]

    return make


def _checkpoint(c: Case) -> None:
    model = load_quantized(c.out)
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    assert torch.equal(emb.rows(IDS), c.embed[IDS])  # the gather dequantizes just those rows
    assert torch.equal(head.dequantized_weight(), c.head)
    assert (head.qweight.data_ptr() == emb.qweight.data_ptr()) == c.tied  # a tied table is one tensor set


def _fp_tables(c: Case, tensors: dict, head_key: str | None) -> None:
    """The per-linear formats write the embedding dequantized; a tied model no head tensor at all."""
    assert torch.equal(tensors[f"{c.embed_name}.weight"].float(), c.embed)
    assert f"{c.embed_name}.qweight" not in tensors
    assert (head_key is None) == c.tied and not (c.tied and any(k.startswith("lm_head.") for k in tensors))


def _compressed_tensors(c: Case, out: Path) -> None:
    from compressed_tensors.compressors.pack_quantized import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig

    tensors = load_file(str(out / "model.safetensors"))
    _fp_tables(c, tensors, None if c.tied else "lm_head")
    if not c.tied:
        cfg = QuantizationConfig.model_validate(json.loads((out / "config.json").read_text())["quantization_config"])
        (group,) = [g for g in cfg.config_groups.values() if "re:^lm_head$" in g.targets]
        local = {k.removeprefix("lm_head."): v for k, v in tensors.items() if k.startswith("lm_head.")}
        assert torch.equal(PackedQuantizationCompressor.decompress(local, group)["weight"], c.head)


def _gptq(c: Case, out: Path) -> None:
    tensors = load_file(str(out / "model.safetensors"))
    qc = json.loads((out / "quantize_config.json").read_text())
    _fp_tables(c, tensors, None if c.tied else "lm_head")
    assert bool(qc["lm_head"]) != c.tied
    if not c.tied:
        got = gptq_dequantize(tensors["lm_head.qweight"], tensors["lm_head.qzeros"], tensors["lm_head.scales"],
                              tensors["lm_head.g_idx"], 4, offset=1 if qc["checkpoint_format"] == "gptq" else 0)
        assert torch.equal(got, c.head)


def _awq(c: Case, out: Path) -> None:
    tensors = load_file(str(out / "model.safetensors"))
    _fp_tables(c, tensors, None if c.tied else "lm_head")
    if not c.tied:
        got = awq_dequantize(tensors["lm_head.qweight"], tensors["lm_head.qzeros"], tensors["lm_head.scales"], 32)
        assert torch.equal(got, c.head)


def _gguf(c: Case, path: Path) -> None:
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    assert ("output.weight" in tensors) != c.tied  # llama.cpp reads token_embd for a tied head
    for name, want in (("token_embd.weight", c.embed), ("output.weight", None if c.tied else c.head)):
        if want is None:
            continue
        t = tensors[name]
        got = gguf.quants.dequantize(t.data, t.tensor_type).reshape(tuple(int(x) for x in reversed(t.shape)))
        assert t.tensor_type.name == {8: "Q8_0", 4: "Q4_1"}[_bits(c, name)], name
        # Q4_1 stores m = -scale * zero rounded to fp16: the one difference from our values (Q8_0: exact)
        np.testing.assert_allclose(got, want.numpy(), rtol=0, atol=2e-3 * float(want.abs().max()), err_msg=name)


def _bits(c: Case, name: str) -> int:
    embed, head = TABLES[c.tied]
    return OUTER_SCHEMES[embed if name.startswith("token_embd") else head].bits


LAYERWISE = {"compressed-tensors": _compressed_tensors, "gptq": _gptq, "awq": _awq}


@pytest.mark.parametrize("family,tied", CASES, ids=[f"{f}-{'tied' if t else 'untied'}" for f, t in CASES])
def test_tables_round_trip_through_every_format(case, tmp_path, family, tied):
    c = case(family, tied)
    _checkpoint(c)
    for fmt, check in LAYERWISE.items():
        if family in MOE_FAMILIES:  # packed experts: the per-linear formats refuse the whole model up front
            with pytest.raises(ValueError, match=f"--format {fmt} cannot carry .*packed MoE experts"):
                export(str(c.out), fmt, tmp_path / fmt)
            continue
        with pytest.raises(ValueError, match=f"--format {fmt} cannot carry the quantized embedding"):
            export(str(c.out), fmt, tmp_path / fmt)
        check(c, export(str(c.out), fmt, tmp_path / fmt, dtype="float32", dequantize_embedding=True))
    if supports(family, "gguf"):
        _gguf(c, export(str(c.out), "gguf", tmp_path / "m.gguf"))
    else:
        with pytest.raises(ValueError, match="gguf"):
            export(str(c.out), "gguf", tmp_path / "m.gguf")


ONNX_CASES = [(f, t) for f, t in CASES if supports(f, "onnx")]


@pytest.mark.slow  # each export traces the whole model: ~5-10 s a format here
@pytest.mark.parametrize("family,tied", ONNX_CASES, ids=[f"{f}-{'tied' if t else 'untied'}" for f, t in ONNX_CASES])
def test_tables_round_trip_through_onnx(case, tmp_path, family, tied):
    """ONNX Runtime's logits equal the checkpoint's: onnx-int4 runs the tables from their codes
    (GatherBlockQuantized, MatMulNBits), onnx from their dequantized values."""
    pytest.importorskip("onnxruntime")
    from compress.exporters.onnx_runner import OnnxCausalLM

    c = case(family, tied)
    with torch.no_grad():
        want = load_quantized(c.out)(IDS).logits
    for fmt in ("onnx-int4", "onnx"):
        got = OnnxCausalLM(export(str(c.out), fmt, tmp_path / fmt))(IDS).logits
        assert float((got - want).abs().max() / want.abs().max()) <= 1e-3, fmt


def test_onnx_refuses_the_families_it_cannot_trace(case, tmp_path):
    c = case("mixtral", False)
    for fmt in ("onnx-int4", "onnx"):
        with pytest.raises(ValueError, match="onnx"):
            export(str(c.out), fmt, tmp_path / fmt)
