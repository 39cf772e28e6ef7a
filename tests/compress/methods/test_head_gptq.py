"""GPTQ of an untied LM head on the final hidden states: the Hessian is of what the head reads, GPTQ's output error
is no worse than RTN's, the held-out comparison keeps the better one, and the quantize paths use it as they say."""
import json
from pathlib import Path

import pytest
import torch

from compress.config import QuantizeConfig, load_recipe
from compress.format.quant import quantize_weight as rtn_weight
from compress.job import quantize_to_folder
from compress.methods.common.fallback import output_error
from compress.methods.common.hessian import Hessian
from compress.methods.embed_head import OUTER_SCHEMES, table_of
from compress.methods.head_gptq import HeadHessians, head_hessians, quantize_head
from folders import folder_tensors, save_tiny, streamed_and_in_memory
from tiny_models import tiny_model


@pytest.mark.parametrize("family", ["llama", "gemma2", "phi3", "olmo2", "granite", "qwen2_moe"])
def test_the_hessian_is_of_what_the_head_reads(family):
    model = tiny_model(family)
    batches = [torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(i)) for i in range(3)]
    want = Hessian.zeros(64)
    hook = model.get_output_embeddings().register_forward_pre_hook(lambda m, args: want.add(args[0]))
    with torch.no_grad():
        for ids in batches:
            model(input_ids=ids, use_cache=False)
    hook.remove()
    seen = []
    hs = head_hessians(model, batches, held=1, progress=lambda *a: seen.append(a))
    assert seen == [(i, 3, "head batch") for i in (0, 1, 2, 3)]  # announced, then after each batch
    whole = head_hessians(model, batches)
    torch.testing.assert_close(whole.fit, want.H, rtol=1e-5, atol=1e-6)
    assert whole.held is None and hs.held is not None
    torch.testing.assert_close((2 * hs.fit + hs.held) / 3, want.H, rtol=1e-5, atol=1e-6)  # equal-size batches


def _correlated(n: int, dim: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(dim, dim, generator=g) * torch.linspace(0.1, 3, dim)
    return torch.randn(n, dim, generator=g) @ mix  # [n, dim], channels of unequal scale, correlated


@pytest.mark.parametrize("choice", ["int8", "int4"])
def test_gptq_head_is_no_worse_than_rtn_on_its_inputs(choice):
    scheme = OUTER_SCHEMES[choice]
    w = torch.randn(500, 64, generator=torch.Generator().manual_seed(1))
    h = Hessian.zeros(64)
    h.add(_correlated(2000, 64, 2))
    res = quantize_head(w, HeadHessians(h.H.clone(), None), scheme)
    assert res.method == "gptq" and res.choice is None and res.weight.g_idx is None
    plain = rtn_weight(w, scheme).dequantize()
    assert output_error(w - res.weight.dequantize(), h.H) < output_error(w - plain, h.H)
    table = table_of(res.weight)  # the packed table the checkpoint stores holds exactly these codes
    assert torch.equal(table.dequantized_weight(), res.weight.dequantize())


def test_the_held_out_windows_pick_rtn_where_it_is_better():
    scheme = OUTER_SCHEMES["int4"]
    w = torch.randn(300, 64, generator=torch.Generator().manual_seed(3))
    fit, held = Hessian.zeros(64), Hessian.zeros(64)
    fit.add(_correlated(2000, 64, 4))
    held.add(torch.randn(2000, 64, generator=torch.Generator().manual_seed(5)))  # another distribution entirely
    res = quantize_head(w, HeadHessians(fit.H, held.H), scheme)
    gptq_err = output_error(w - quantize_head(w, HeadHessians(fit.H, None), scheme).weight.dequantize(), held.H)
    rtn_err = output_error(w - rtn_weight(w, scheme).dequantize(), held.H)
    assert res.method == ("rtn" if rtn_err < gptq_err else "gptq")
    assert res.note().judged.choice == ("rtn" if res.method == "rtn" else "kept")
    same = quantize_head(w, HeadHessians(fit.H, fit.H), scheme)  # judged on its own windows GPTQ wins
    assert same.method == "gptq"


@pytest.mark.parametrize("choice", ["int8", "int4"])
def test_row_slabs_round_as_one_pass(choice):
    """GPTQ rounds each row against the same Hessian on its own: slabs of rows (a ragged last one included) give one
    pass's codes, and the held-out errors summed over the slabs make the same choice with the same figures."""
    scheme = OUTER_SCHEMES[choice]
    w = torch.randn(700, 64, generator=torch.Generator().manual_seed(6))
    fit, held = Hessian.zeros(64), Hessian.zeros(64)
    fit.add(_correlated(2000, 64, 7))
    held.add(_correlated(500, 64, 8))
    whole = quantize_head(w, HeadHessians(fit.H, held.H), scheme, slab=10_000)
    slabs = quantize_head(w, HeadHessians(fit.H, held.H), scheme, slab=256)
    assert torch.equal(slabs.weight.q, whole.weight.q) and torch.equal(slabs.weight.scale, whole.weight.scale)
    assert (slabs.weight.zero is None) == (whole.weight.zero is None)
    if whole.weight.zero is not None:
        assert torch.equal(slabs.weight.zero, whole.weight.zero)
    assert slabs.method == whole.method
    assert slabs.choice.error == pytest.approx(whole.choice.error, rel=1e-5)
    assert slabs.choice.rtn_error == pytest.approx(whole.choice.rtn_error, rel=1e-5)
    assert slabs.loss == pytest.approx(whole.loss, rel=1e-5)


def test_config():
    assert QuantizeConfig(head="int4", head_method="gptq").needs_calibration
    assert not QuantizeConfig(head_method="gptq").calibrated_head  # no quantized head: nothing to calibrate
    with pytest.raises(ValueError, match="head_method='awq' is unknown"):
        QuantizeConfig(head="int4", head_method="awq")


def test_an_untied_head_is_calibrated_in_memory(tmp_path, smol_tokenizer, calib_text):
    src = save_tiny(tmp_path, "llama", smol_tokenizer)  # untied
    cfg = load_recipe("rtn4").replace(calib=str(calib_text), nsamples=8, seqlen=32, batch_size=2, embed="none",
                                      head="int4", head_method="gptq")
    with pytest.raises(ValueError, match="head_method: gptq calibrates the head"):
        quantize_to_folder(str(src), cfg, str(tmp_path / "s"), stream=True)
    res = quantize_to_folder(str(src), cfg, str(tmp_path / "g"))
    rtn = quantize_to_folder(str(src), cfg.replace(head_method="rtn"), str(tmp_path / "r"))
    assert not res.streamed and rtn.streamed
    qc = json.loads((Path(res.out) / "config.json").read_text())["quantization_config"]
    assert qc["head_calibration"]["method"] in ("gptq", "rtn") and "heldout_error" in qc["head_calibration"]
    a, b = folder_tensors(res.out), folder_tensors(rtn.out)
    body = [k for k in a if not k.startswith("lm_head.")]
    assert all(torch.equal(a[k], b[k]) for k in body)  # the body is RTN's either way
    assert a["lm_head.qweight"].shape == b["lm_head.qweight"].shape
    assert (qc["head_calibration"]["method"] == "rtn") == torch.equal(a["lm_head.qweight"], b["lm_head.qweight"])


def test_a_tied_table_is_calibrated_once_for_both(tmp_path, smol_tokenizer, calib_text):
    """Gemma (tied, its lookups scaled by sqrt(hidden)): the one table rounded for the head, read by both."""
    from compress.format.checkpoint import load_quantized

    src = save_tiny(tmp_path, "gemma", smol_tokenizer)
    cfg = load_recipe("rtn4").replace(calib=str(calib_text), nsamples=8, seqlen=32, batch_size=2, embed="int4",
                                      head="int4", head_method="gptq", fallback=False)
    res = quantize_to_folder(str(src), cfg, str(tmp_path / "g"))
    rtn = quantize_to_folder(str(src), cfg.replace(head_method="rtn"), str(tmp_path / "r"))
    assert not res.streamed and rtn.streamed
    a, b = folder_tensors(res.out), folder_tensors(rtn.out)
    assert a.keys() == b.keys() and not any(k.startswith("lm_head.") for k in a)
    assert not torch.equal(a["model.embed_tokens.qweight"], b["model.embed_tokens.qweight"])
    assert all(torch.equal(a[k], b[k]) for k in a if not k.startswith("model.embed_tokens."))
    qc = json.loads((Path(res.out) / "config.json").read_text())["quantization_config"]
    assert qc["head_calibration"]["method"] == "gptq" and qc["head"]["tied"]
    model, fp = load_quantized(res.out), load_quantized(rtn.out)
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    assert head.qweight.data_ptr() == emb.qweight.data_ptr()
    assert emb.embed_scale == fp.get_input_embeddings().embed_scale is not None


@pytest.mark.parametrize("family,recipe,embed", [("llama", "gptq4", "none"), ("gemma", "awq4", "int4"),
                                                 ("gemma2", "gptq4", "int8")])
def test_a_calibrated_head_streams_as_it_quantizes_in_memory(tmp_path, smol_tokenizer, calib_text, family, recipe,
                                                               embed):
    """gptq and awq runs end with the last block's outputs: the streamed head (untied Llama; tied Gemma, its lookups
    scaled; Gemma 2, whose final norm only the family table names) is calibrated on them after the final norm, and
    the checkpoint is the in-memory one."""
    src = save_tiny(tmp_path, family, smol_tokenizer)
    cfg = load_recipe(recipe).replace(calib=str(calib_text), nsamples=8, seqlen=32, batch_size=2, embed=embed,
                                      head="int4" if embed == "none" else embed, head_method="gptq")
    streamed, _ = streamed_and_in_memory(src, cfg, tmp_path)
    qc = json.loads((Path(streamed.out) / "config.json").read_text())["quantization_config"]
    assert qc["head_calibration"]["method"] in ("gptq", "rtn")
