import copy

import pytest
import torch
from tiny_models import tiny_model

from compress import gptq, onepass
from compress.calibrate import capture_inputs, decoder_layers, target_linears
from compress.config import QuantizeConfig
from compress.guided import token_weights
from compress.pipeline import quantize_model

BATCHES = list(torch.randint(0, 256, (4, 12), generator=torch.Generator().manual_seed(0)).split(2))


def _block_by_block(model, weights=None):
    """The reference: each block observed on the fp model's own block inputs (nothing quantized)."""
    inputs, out = capture_inputs(model, BATCHES), {}
    for i, block in enumerate(decoder_layers(model)):
        linears = target_linears(block, ())
        w = None if weights is None else {n: weights[(i, n)] for n in linears}
        out.update({(i, n): h for n, h in gptq.observe(block, linears, inputs, w).items()})
        inputs.hidden = inputs.forward(block)
    return out


@pytest.mark.parametrize("family", ["llama", "gemma", "qwen2"])
def test_one_pass_hessians_are_the_fp_models_block_by_block_ones(family):
    model = tiny_model(family, layers=2)
    want, got = _block_by_block(model), onepass.hessians(model, BATCHES)
    assert set(got) == set(want)
    for key in want:
        assert got[key].n == want[key].n == 4 * 12
        assert torch.allclose(got[key].H, want[key].H, rtol=1e-4, atol=1e-5), key
    q, k = got[(1, "self_attn.q_proj")], got[(1, "self_attn.k_proj")]
    assert q is k  # one input, one Hessian, as block by block
    assert got[(1, "mlp.down_proj")] is not got[(1, "mlp.up_proj")]


def test_guided_one_pass_hessians_weigh_each_token_by_its_gradient():
    model = tiny_model("llama", layers=2)
    want = _block_by_block(model, token_weights(model, BATCHES))
    got = onepass.hessians(model, BATCHES, guided=True)
    assert all(p.grad is None and p.requires_grad for p in model.parameters())
    assert got[(0, "self_attn.q_proj")] is not got[(0, "self_attn.k_proj")]
    for key in want:  # the same weights; the pass sees the inputs as bfloat16 autocast leaves them
        assert torch.allclose(got[key].H, want[key].H, rtol=0.05, atol=0.05 * want[key].H.abs().max()), key


@pytest.mark.parametrize("family, guided", [("llama", False), ("llama", True), ("gemma", True), ("phi3", False)])
def test_one_pass_gptq_end_to_end_saved_and_reloaded(family, guided, tmp_path):
    from compress.checkpoint import build_quantization_config, load_quantized, save_quantized

    cfg = QuantizeConfig.from_flat(method="gptq", bits=4, group_size=32, act_order=True, static_groups=True,
                                   mse=True, guided=guided, sequential=False)
    base = tiny_model(family, layers=2)
    model = copy.deepcopy(base)
    report = quantize_model(model, cfg, BATCHES)
    assert len(report.layers) == 2 * len(target_linears(decoder_layers(base)[0], ()))
    save_quantized(model, None, tmp_path / "q", build_quantization_config(model, cfg.method, cfg.scheme))
    ids = BATCHES[0]
    with torch.no_grad():
        ref, out, again = base(input_ids=ids).logits, model(input_ids=ids).logits, \
            load_quantized(tmp_path / "q")(input_ids=ids).logits
    assert torch.equal(out, again)
    assert torch.isfinite(out).all() and (out - ref).abs().mean() < ref.abs().mean()


def test_one_pass_is_refused_on_mixture_of_experts_and_for_awq():
    model = tiny_model("qwen2_moe", layers=1)
    cfg = QuantizeConfig.from_flat(method="gptq", bits=4, group_size=32, sequential=False)
    with pytest.raises(ValueError, match="sequential: false .* experts"):
        quantize_model(model, cfg, BATCHES)
    with pytest.raises(ValueError, match="sequential: false applies to method gptq \\(or qat with init: gptq\\) only"):
        QuantizeConfig.from_flat(method="awq", rounding="gptq", sequential=False)


def test_one_pass_is_not_streamed_and_its_memory_counts_every_hessian():
    from types import SimpleNamespace

    from compress.job import why_not_streamed
    from compress.memory import plan

    cfg = QuantizeConfig.from_flat(method="gptq", bits=4, group_size=32, sequential=False)
    assert "one pass of the whole fp model" in why_not_streamed(SimpleNamespace(quantized=False), cfg)
    model = tiny_model("llama", layers=4)
    one_block = plan(model, cfg.replace(sequential=True), streamed=False)
    every = plan(model, cfg, streamed=False)
    hessians = sum(m.in_features ** 2 * 4 for b in decoder_layers(model) for m in target_linears(b, ()).values())
    assert every.statistics >= hessians > one_block.statistics


def test_bfloat16_products_stay_close_to_float32():
    model = tiny_model("llama", layers=2)
    full, low = onepass.hessians(model, BATCHES), onepass.hessians(model, BATCHES, autocast=torch.bfloat16)
    assert all(h.product == torch.bfloat16 for h in low.values())
    for key, h in full.items():
        assert torch.allclose(low[key].H, h.H, rtol=0.05, atol=0.02 * h.H.abs().max()), key


def _assert_mixed(got, weighted, plain, sequential, mix):
    """``got`` is mix parts ``weighted`` and 1 - mix parts ``plain``, and matches the sequential pass's Hessians
    (token weights from compress/guided.py) to bfloat16 rounding."""
    for key, h in got.items():
        want = mix * weighted[key].H + (1 - mix) * plain[key].H
        assert torch.allclose(h.H, want, rtol=0.01, atol=0.01 * want.abs().max()), key
        assert torch.allclose(h.H, sequential[key].H, rtol=0.05, atol=0.05 * want.abs().max()), key


@pytest.mark.parametrize("mix", [0.5, 0.25])
def test_mixed_hessians_are_the_weighted_and_plain_ones_in_proportion(mix):
    model = tiny_model("llama", layers=2)
    weighted = onepass.hessians(model, BATCHES, guided=True)
    plain = onepass.hessians(model, BATCHES, autocast=torch.bfloat16)  # as the guided pass sees the inputs, to rounding
    mixed = onepass.hessians(model, BATCHES, guided=True, mix=mix)
    _assert_mixed(mixed, weighted, plain, _block_by_block(model, token_weights(model, BATCHES, mix=mix)), mix)


def test_guided_mix_needs_guided():
    with pytest.raises(ValueError, match="guided_mix=0.5 mixes guided GPTQ's Hessians"):
        QuantizeConfig.from_flat(method="gptq", guided_mix=0.5)
    with pytest.raises(ValueError, match="guided_mix=0 must be in"):
        QuantizeConfig.from_flat(method="gptq", guided=True, guided_mix=0)


def test_guided_nsamples_weighs_the_first_sequences_and_keeps_every_plain_one():
    model = tiny_model("llama", layers=2)
    mix, k = 0.5, 3
    got = onepass.hessians(model, BATCHES, guided=True, mix=mix, guided_nsamples=k)
    first = list(torch.cat(BATCHES)[:k].split(2))
    weighted = onepass.hessians(model, first, guided=True)
    plain = onepass.hessians(model, BATCHES, autocast=torch.bfloat16)
    _assert_mixed(got, weighted, plain, _block_by_block(model, token_weights(model, BATCHES, mix=mix, nsamples=k)), mix)


def test_guided_nsamples_is_checked():
    with pytest.raises(ValueError, match="guided_nsamples=2 leaves the other sequences to the plain Hessian"):
        QuantizeConfig.from_flat(method="gptq", guided=True, guided_nsamples=2)  # mix 1: nothing would use them
    with pytest.raises(ValueError, match="guided_nsamples=-1 must be >= 1"):
        QuantizeConfig.from_flat(method="gptq", guided=True, guided_mix=0.5, guided_nsamples=-1)
    model = tiny_model("llama", layers=1)  # more than there are: all of them
    every, more = onepass.hessians(model, BATCHES, guided=True, mix=0.5), \
        onepass.hessians(model, BATCHES, guided=True, mix=0.5, guided_nsamples=99)
    assert all(torch.equal(every[k].H, more[k].H) for k in every)
