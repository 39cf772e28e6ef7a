"""The fallback to RTN (compress/methods/common/fallback.py): the split of the calibration windows, the choice on held-out output
error, and on a tiny model whose calibration windows mislead (fit windows in half of the hidden channels, held-out
windows in the other half) GPTQ and AWQ keep RTN and record it, an AWQ group that falls back left exactly unscaled."""
from __future__ import annotations

import copy
import logging

import pytest
import torch
from tiny_models import tiny_model

from compress.config import QuantizeConfig
from compress.format import quant
from compress.format.quant import Scheme
from compress.methods.common import fallback
from compress.methods.common import gptq_solver
from compress.methods.common.report import Judgement, SmoothRecord
from compress.pipeline import quantize_model

SCHEME = Scheme(bits=4, group_size=32, sym=False)


@pytest.mark.parametrize("n, share, held", [(8, 0.125, 1), (8, 0.25, 2), (16, 0.125, 2), (2, 0.125, 1), (9, 0.01, 1),
                                           (2, 0.9, 1), (4, 0.99, 3)])
def test_split_holds_out_the_last_share_at_least_one(n, share, held):
    windows = torch.arange(n * 3).reshape(n, 3)
    split = fallback.split_windows(list(windows.split(4)), share)
    assert sum(b.shape[0] for b in split.held) == held
    assert torch.equal(torch.cat(split.fit + split.held), windows)  # the same windows, in order
    assert all(b.shape[0] <= 4 for b in split.fit + split.held)


def test_one_window_is_not_split():
    split = fallback.split_windows([torch.zeros(1, 5, dtype=torch.long)], 0.5)
    assert split.held == [] and len(split.fit) == 1


def test_a_tie_keeps_the_calibrated_result_and_a_group_sums():
    assert not fallback.Choice(1.0, 1.0, 10.0).rtn
    assert fallback.Choice(1.0, 0.9, 10.0).rtn
    group = fallback.combine([fallback.Choice(1.0, 0.5, 4.0), fallback.Choice(1.0, 2.0, 6.0)])
    assert (group.error, group.rtn_error, group.energy, group.rtn) == (2.0, 2.5, 10.0, False)
    assert fallback.Choice(2.0, 1.0, 10.0).judgement() == Judgement(0.2, 0.1, "rtn")


def test_output_error_is_the_squared_output_error():
    x, d = torch.randn(50, 8), torch.randn(4, 8)
    assert fallback.output_error(d, x.T @ x) == pytest.approx((x @ d.T).pow(2).sum().item(), rel=1e-4)


def _hessian(x):
    h = gptq_solver.Hessian.zeros(x.shape[1])
    h.add(x)
    return fallback.Gram(h.H)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_judge_as_the_gram_matrix_does(dtype):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(300, 40, generator=gen).to(dtype)
    deltas = [torch.randn(6, 40, generator=gen), torch.randn(6, 40, generator=gen) * 0.1, torch.zeros(6, 40)]
    by_rows = fallback.Rows(x, chunk=64).errors(deltas)  # chunks that do not divide the rows
    assert by_rows == pytest.approx(_hessian(x.float()).errors(deltas), rel=1e-5, abs=1e-12)
    assert by_rows[2] == 0.0


def test_rows_are_chosen_for_a_wide_input_feeding_a_narrow_output():
    assert fallback.rows_cheaper(8192, 4864, 896)  # the 0.5b shape's down_proj: 3.5x fewer products
    assert not fallback.rows_cheaper(8192, 896, 896)  # o_proj
    assert not fallback.rows_cheaper(8192, 896, 4864)  # gate/up
    assert fallback.rows_cheaper(8192, 1536, 576)  # SmolLM2's down_proj, barely
    assert not fallback.rows_cheaper(100_000, 1536, 576)  # not over many rows: the Gram matrix is formed once


def _inputs(n, basis, gen):
    """``n`` correlated inputs spanning the rows of ``basis`` only."""
    return torch.randn(n, basis.shape[0], generator=gen) @ basis


def test_gptq_fit_on_one_subspace_falls_back_off_it():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(48, 64, generator=gen)
    basis = torch.linalg.qr(torch.randn(64, 64, generator=gen))[0].T  # orthonormal rows
    fit, held = _inputs(512, basis[:32], gen), _inputs(128, basis[32:], gen)
    q = gptq_solver.quantize_weight(w, _hessian(fit).H, SCHEME).weight.dequantize()
    plain = quant.quantize_weight(w, SCHEME).dequantize()
    assert fallback.compare(w, q, plain, _hessian(held)).rtn  # off the fit subspace GPTQ is worse
    assert not fallback.compare(w, q, plain, _hessian(_inputs(128, basis[:32], gen))).rtn  # on it, better


def test_gptq_keeps_its_result_where_it_generalizes():
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(48, 64, generator=gen)
    mix = torch.randn(64, 64, generator=gen) * torch.linspace(0.05, 2, 64)  # correlated, uneven channels
    fit, held = torch.randn(1024, 64, generator=gen) @ mix, torch.randn(256, 64, generator=gen) @ mix
    q = gptq_solver.quantize_weight(w, _hessian(fit).H, SCHEME).weight.dequantize()
    choice = fallback.compare(w, q, quant.quantize_weight(w, SCHEME).dequantize(), _hessian(held))
    assert not choice.rtn and choice.error < 0.9 * choice.rtn_error


# -- through the pipeline: a tiny llama with an outlier hidden channel (AWQ scales the others down against it) --------
def _model(misled: bool):
    """``misled``: the fit windows use tokens 0..127, embedded in the even hidden channels, and the held-out (last)
    window tokens 128..255, embedded in the odd ones (every quantization group holds both); else every window draws
    from 0..127."""
    model = tiny_model("llama", layers=1)
    with torch.no_grad():
        emb = model.get_input_embeddings().weight
        emb[:128, 1::2] = 0
        emb[128:, 0::2] = 0
        emb[:128, 0] *= 30
    gen = torch.Generator().manual_seed(0)
    held = torch.randint(128, 256, (1, 16), generator=gen) if misled else torch.randint(0, 128, (1, 16), generator=gen)
    windows = torch.cat([torch.randint(0, 128, (7, 16), generator=gen), held])
    return model, list(windows.split(4))


CFG = {"bits": 4, "group_size": 32, "search_tokens": 64, "grid": 5, "clip_grid": 5}


METHODS = {"gptq": {"method": "gptq"}, "gptq-act-order": {"method": "gptq", "act_order": True}, "gptq-fp": {"method": "gptq", "sequential": False},
           "guided-gptq": {"method": "gptq", "guided": True},
           "guided-fp": {"method": "gptq", "guided": True, "guided_mix": 0.5, "sequential": False},
           "awq": {"method": "awq"}, "awq-gptq": {"method": "awq", "rounding": "gptq"}}


@pytest.mark.parametrize("method", METHODS)
def test_misleading_calibration_falls_back_to_rtn_and_records_it(method):
    model, batches = _model(misled=True)
    report = quantize_model(model, QuantizeConfig.from_flat(**CFG, **METHODS[method]), batches)
    note = report.notes.fallback
    assert note.heldout_windows == 1 and note.judged == 7
    qkv = [f"model.layers.0.self_attn.{p}_proj" for p in "qkv"]
    assert all(note.layers.get(n) == "rtn" for n in qkv), note  # they read the embeddings' subspace
    assert note.rtn == len(note.layers)
    judged = [r.judged for r in report.layers if r.judged is not None]
    assert all(j.rtn_heldout_error < j.heldout_error for j in judged if j.choice == "rtn")
    assert all(j.rtn_heldout_error >= j.heldout_error for j in judged if j.choice == "kept")
    act_order = METHODS[method].get("act_order", False)  # every linear carries a g_idx, or none does
    assert all((m.g_idx is not None) == act_order for m in model.modules() if hasattr(m, "g_idx"))


def test_awq_groups_that_fall_back_are_rtn_of_the_unscaled_weights():
    model, batches = _model(misled=True)
    fp = copy.deepcopy(model)
    report = quantize_model(model, QuantizeConfig.from_flat(**CFG, method="awq"), batches)
    assert report.notes.fallback.rtn == 7  # every group: the block is RTN's, its norms untouched
    block, fp_block = model.model.layers[0], fp.model.layers[0]
    for name in ("input_layernorm", "post_attention_layernorm"):
        assert torch.equal(block.get_submodule(name).weight, fp_block.get_submodule(name).weight)
    for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                 "mlp.up_proj", "mlp.down_proj"):
        want = quant.quantize_weight(fp_block.get_submodule(name).weight.data, SCHEME)
        assert torch.equal(block.get_submodule(name).dequantized_weight(), want.dequantize()), name


@pytest.mark.parametrize("method", METHODS)
def test_the_calibrated_result_is_kept_where_it_holds_on_held_out_windows(method, caplog):
    model, batches = _model(misled=False)
    with caplog.at_level(logging.INFO, logger="compress"):
        report = quantize_model(model, QuantizeConfig.from_flat(**CFG, **METHODS[method]), batches)
    assert report.notes.fallback.rtn == 0
    logged = sum("held-out error" in r.getMessage() for r in caplog.records)  # what -v prints
    assert logged == (4 if "awq" in method else 7)  # AWQ: 3 groups and o_proj alone (GQA); GPTQ: each linear
    groups = {r.smooth: r for r in report.layers if isinstance(r, SmoothRecord)}
    if groups:  # AWQ's scales are kept, not only its no-scale point; the clipped ranges' share is recorded
        assert groups["input_layernorm"].judged.choice == "kept" and groups["input_layernorm"].ratio > 0
        assert all(0.5 <= g.clip <= 1 for g in groups.values())


def test_without_fallback_every_window_fits_and_nothing_is_judged():
    model, batches = _model(misled=True)
    report = quantize_model(model, QuantizeConfig.from_flat(**CFG, method="gptq", fallback=False), batches)
    assert report.notes.fallback is None and not any(r.judged for r in report.layers)


@pytest.mark.parametrize("value", [0.0, 1.0, -0.1])
def test_holdout_outside_0_1_is_refused(value):
    with pytest.raises(ValueError, match="holdout"):
        QuantizeConfig(holdout=value)


@pytest.mark.parametrize("stream", [True, False])
def test_the_checkpoint_and_the_summary_carry_the_choices(tmp_path, tiny_dir, calib_text, stream):
    import json

    from compress.job import quantize_to_folder

    cfg = QuantizeConfig.from_flat(**CFG, method="gptq", calib=str(calib_text), nsamples=8, seqlen=32, batch_size=4)
    res = quantize_to_folder(str(tiny_dir), cfg, str(tmp_path / "q"), stream=stream)
    qc = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    assert qc["fallback"] == res.report.notes.fallback.to_json() and qc["fallback"]["judged"] == 14  # 2 blocks x 7
    assert qc["fallback"]["heldout_windows"] == 1 and qc["config"]["fallback"] and qc["config"]["holdout"] == 0.125
    assert set(qc["fallback"]["layers"]) <= set(qc["modules"])
    line = next(x for x in res.lines() if x.startswith("fallback:"))
    assert line.startswith(f"fallback: {qc['fallback']['rtn']} of 14 layers kept RTN")


def test_refit_solves_the_kept_layers_again_on_every_window():
    """``refit``: the held-out windows choose GPTQ, then its weight is solved on all windows (the pooled Hessian):
    what GPTQ without a fallback computes, while the choices stay recorded (not under act-order, whose column order
    a last-bit difference between the two Hessians may change)."""
    model, batches = _model(misled=False)
    cfg = QuantizeConfig.from_flat(**CFG, method="gptq")
    refit, whole = copy.deepcopy(model), copy.deepcopy(model)
    report = quantize_model(refit, cfg.replace(refit=True), batches)
    quantize_model(whole, cfg.replace(fallback=False), batches)
    assert report.notes.fallback.judged == 7 and report.notes.fallback.rtn == 0
    for (name, a), b in zip(refit.named_modules(), whole.modules()):
        if hasattr(a, "g_idx"):
            torch.testing.assert_close(a.dequantized_weight(), b.dequantized_weight(), rtol=0, atol=1e-6, msg=name)


def test_pooled_hessian_is_the_mean_over_every_token():
    g = torch.Generator().manual_seed(0)
    x_fit, x_held = torch.randn(48, 8, generator=g), torch.randn(16, 8, generator=g)
    fit, held, whole = (gptq_solver.Hessian.zeros(8) for _ in range(3))
    fit.add(x_fit), held.add(x_held), whole.add(torch.cat([x_fit, x_held]))
    from compress.methods.gptq import pooled
    torch.testing.assert_close(pooled(fit.H, fit.n, held), whole.H)
    torch.testing.assert_close(pooled(fit.H, fit.n, held, 0.5), (48 * fit.H + 8 * held.H) / 64)
