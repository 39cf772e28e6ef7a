"""Quantized input embedding and LM head: the codes, the checkpoint format, both quantize paths, loading back."""
import json
from pathlib import Path

import pytest
import torch

from compress.config import QuantizeConfig, load_recipe
from compress.format.quant import compute_qparams, dequantize, quantize
from compress.job import quantize_to_folder
from compress.methods.embed_head import OUTER_SCHEMES, outer_scheme, plan_outer, quantize_table, row_slabs
from folders import folder_tensors, save_tiny
from tiny_models import tiny_model


@pytest.mark.parametrize("choice", ["int8", "int4"])
def test_table_codes_do_not_depend_on_the_slabs(choice):
    w = torch.randn(300, 72)
    scheme = OUTER_SCHEMES[choice]
    a = quantize_table(row_slabs(w, 7), 300, 72, scheme)
    b = quantize_table(row_slabs(w, 300), 300, 72, scheme)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    scale, zero = compute_qparams(w, scheme)
    want = dequantize(quantize(w, scale, zero, scheme), scale, zero, scheme)
    assert torch.equal(a.dequantized_weight(), want)
    ids = torch.tensor([[5, 0, 299], [5, 17, 3]])
    assert torch.equal(a(ids), want[ids])  # a lookup dequantizes just the rows it names
    torch.testing.assert_close(a.as_linear()(torch.ones(2, 72)), torch.ones(2, 72) @ want.T)


def test_config_fields_are_validated():
    assert QuantizeConfig(embed="int8").outer_scheme("embed") == OUTER_SCHEMES["int8"]
    assert QuantizeConfig(head="int4", head_group_size=64).outer_scheme("head").group_size == 64
    assert outer_scheme("none") is None
    with pytest.raises(ValueError, match="embed='int16' is unknown"):
        QuantizeConfig(embed="int16")
    with pytest.raises(ValueError, match="head is none"):
        QuantizeConfig(head_group_size=64)
    with pytest.raises(ValueError, match="group_size=3"):
        QuantizeConfig(embed="int4", embed_group_size=3)
    with pytest.raises(ValueError, match="head_sym"):
        QuantizeConfig(head="int8", head_sym="yes")


def test_a_tied_model_takes_one_scheme():
    tied = plan_outer(QuantizeConfig(head="int8"), tied=True)
    assert tied.embed == OUTER_SCHEMES["int8"] and tied.head is None and tied.tied
    untied = plan_outer(QuantizeConfig(embed="int8", head="int4"), tied=False)
    assert untied.embed == OUTER_SCHEMES["int8"] and untied.head == OUTER_SCHEMES["int4"]
    with pytest.raises(ValueError, match="ties its LM head"):
        plan_outer(QuantizeConfig(embed="int8", head="int4"), tied=True)


def test_tied_model_with_two_schemes_is_refused_before_any_work(tmp_path, smol_tokenizer):
    src = save_tiny(tmp_path, "gemma", smol_tokenizer)
    with pytest.raises(ValueError, match="--embed int8 --head int8"):
        quantize_to_folder(str(src), load_recipe("rtn4").replace(embed="int8", head="int4"), str(tmp_path / "o"))
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("family,recipe,embed,head", [("llama", "rtn4", "int8", "int4"), ("gemma", "awq4", "int8", "none"),
                                                      ("qwen2", "gptq4", "none", "int8"), ("gemma", "rtn4", "none", "int4")])
def test_both_paths_write_the_same_quantized_tables(tmp_path, smol_tokenizer, calib_text, family, recipe, embed, head):
    src = save_tiny(tmp_path, family, smol_tokenizer)
    tied = json.loads((src / "config.json").read_text()).get("tie_word_embeddings", False)
    cfg = load_recipe(recipe).replace(calib=str(calib_text), nsamples=4, seqlen=32, batch_size=2, embed=embed, head=head)
    streamed = quantize_to_folder(str(src), cfg, str(tmp_path / "s"), stream=True)
    whole = quantize_to_folder(str(src), cfg, str(tmp_path / "m"), stream=False)
    a, b = folder_tensors(streamed.out), folder_tensors(whole.out)
    assert a.keys() == b.keys() and [k for k in a if not torch.equal(a[k], b[k])] == []
    qc = json.loads((Path(streamed.out) / "config.json").read_text())["quantization_config"]
    assert qc == json.loads((Path(whole.out) / "config.json").read_text())["quantization_config"] | {
        "source_model": qc["source_model"]}
    embed_q = embed != "none" or (tied and head != "none")
    assert ("model.embed_tokens.qweight" in a) == embed_q and ("model.embed_tokens.weight" in a) != embed_q
    assert (qc["embed"] is not None) == embed_q and "model.embed_tokens" not in qc["modules"]
    if tied:
        assert not any(k.startswith("lm_head.") for k in a) and "lm_head" not in qc["modules"]
        assert (qc["head"] or {}).get("tied", embed_q) == embed_q
    else:
        assert ("lm_head.qweight" in a) == (head != "none") and ("lm_head" in qc["modules"]) == (head != "none")
    if embed_q:
        assert a["model.embed_tokens.qweight"].dtype == torch.int32 and a["model.embed_tokens.scales"].dtype == torch.float16


@pytest.mark.parametrize("family,embed,head", [("llama", "int8", "int8"), ("gemma", "int4", "none"),
                                               ("qwen2", "int4", "int8")])
def test_quantized_tables_load_back(tmp_path, smol_tokenizer, family, embed, head):
    from compress.format.checkpoint import load_quantized
    from compress.format.qlinear import QuantEmbedding, QuantLinear

    src = save_tiny(tmp_path, family, smol_tokenizer)
    cfg = load_recipe("rtn4").replace(embed=embed, head=head)
    out = quantize_to_folder(str(src), cfg, str(tmp_path / "q")).out
    model = load_quantized(out)
    emb, lm = model.get_input_embeddings(), model.get_output_embeddings()
    assert isinstance(emb, QuantEmbedding) and isinstance(lm, QuantLinear)
    if model.config.tie_word_embeddings:
        assert lm.qweight.data_ptr() == emb.qweight.data_ptr()  # one tensor set
    # the reference: the same checkpoint with the tables dequantized into the plain fp modules
    ref = tiny_model(family, vocab=len(smol_tokenizer))
    with torch.no_grad():
        ref.load_state_dict({k: v for k, v in model.state_dict().items() if k in ref.state_dict()}, strict=False)
        from compress.format.checkpoint import set_module
        for n, m in list(model.named_modules()):
            if isinstance(m, QuantLinear) and n != "lm_head":
                set_module(ref, n, m)
        ref.get_input_embeddings().weight.copy_(emb.dequantized_weight())
        if not model.config.tie_word_embeddings:
            ref.lm_head.weight.copy_(lm.dequantized_weight())
    ids = torch.randint(0, len(smol_tokenizer), (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref(ids).logits, rtol=1e-4, atol=1e-4)
