import copy

import pytest
import torch
from tiny_models import FAMILIES, tiny_model

from compress.config import QuantizeConfig
from compress.format.checkpoint import build_quantization_config, load_quantized, quantized_modules, save_quantized
from compress.format.qlinear import QuantLinear
from compress.format.quant import Scheme, compute_qparams, dequantize, quantize
from compress.methods import qat
from compress.pipeline import METHODS, quantize_model
from compress.train import cosine_factor, evaluate_kl


def _batches(vocab=256, n=8, seqlen=32, seed=0, batch=4):
    g = torch.Generator().manual_seed(seed)
    return list(torch.randint(0, vocab, (n, seqlen), generator=g).split(batch))


def _fake(out_f=16, in_f=80, scheme=Scheme(4, 32), learn_zero=False, seed=0, lr_in_steps=False):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_f, in_f, generator=g) * 0.05
    scale, zero = compute_qparams(w, scheme)
    return qat.FakeQuantLinear(w, torch.randn(out_f, generator=g), scale, zero, scheme, learn_zero, lr_in_steps)


def test_round_ste_is_round_forward_and_identity_backward():
    x = torch.linspace(-3, 3, 41, requires_grad=True)
    y = qat.round_ste(x)
    assert torch.equal(y, torch.round(x.detach()))
    y.sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))


@pytest.mark.parametrize("learn_zero,lr_in_steps", [(False, False), (True, False), (False, True)])
def test_ste_gradients_reach_weights_scales_and_zeros(learn_zero, lr_in_steps):
    f = _fake(learn_zero=learn_zero, lr_in_steps=lr_in_steps)
    with torch.no_grad():  # shrink some scales so a few weights fall outside the grid and clamp
        f.log_scale[:, 0] -= 1.0
    x = torch.randn(8, 80)
    f(x).pow(2).sum().backward()
    assert f.latent.grad is not None and f.latent.grad.abs().sum() > 0
    assert f.log_scale.grad is not None and f.log_scale.grad.abs().sum() > 0
    clamped = (f.latent.grad == 0).any()  # weights outside the grid get no STE gradient
    assert clamped
    if learn_zero:
        assert f.zero.grad is not None and f.zero.grad.abs().sum() > 0
    else:
        assert not isinstance(f.zero, torch.nn.Parameter)


def _reference_fake_weight(f: qat.FakeQuantLinear):
    """The same fake quantization written with plain autograd and round_ste, on [out, in]."""
    from compress.format.quant import group_index

    s, z = f.qparams()
    gi = group_index(f.in_features, f.scheme)
    s = s.index_select(1, gi)
    z = z.index_select(1, gi) if isinstance(z, torch.Tensor) else z
    q = torch.clamp(qat.round_ste(f.weight / s) + z, 0, f.scheme.maxq)
    return (q - z) * s


@pytest.mark.parametrize("lr_in_steps", [False, True])
@pytest.mark.parametrize("scheme", [Scheme(4, 32), Scheme(3, 24, sym=True)], ids=str)
def test_closed_form_lsq_gradients_equal_autograd_through_round_ste(scheme, lr_in_steps):
    f = _fake(scheme=scheme, learn_zero=True, lr_in_steps=lr_in_steps)
    with torch.no_grad():
        f.log_scale[:, 0] -= 1.0  # some weights clamp
    x = torch.randn(8, 80)
    grads = []
    for fw in (f.fake_weight, lambda: _reference_fake_weight(f)):
        f.zero_grad()
        w = fw()
        (x @ w.T).pow(2).sum().backward()
        grads.append([p.grad.clone() for p in f.parameters() if p.requires_grad])
    assert torch.equal(f.fake_weight(), _reference_fake_weight(f))
    assert len(grads[0]) == len(grads[1]) == (3 if scheme.has_zeros else 2)
    for a, b in zip(*grads):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6)


def test_lr_in_steps_keeps_no_extra_weight_sized_tensor_for_the_backward():
    def saved_bytes(f):
        total = []

        def pack(t):
            total.append(t.numel() * t.element_size())
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            f(torch.randn(8, 80)).sum()
        return sum(total)
    plain, steps = saved_bytes(_fake()), saved_bytes(_fake(lr_in_steps=True))
    assert steps - plain == _fake(lr_in_steps=True).unit.numel() * 4  # the [out, G] unit, not an [out, in] copy


@pytest.mark.parametrize("lr_in_steps", [False, True])
@pytest.mark.parametrize("scheme", [Scheme(4, 32), Scheme(4, 32, sym=True), Scheme(3, 64), Scheme(8, -1, sym=True)],
                         ids=str)
def test_initial_fake_weight_is_rtn_exactly(scheme, lr_in_steps):
    model = tiny_model("llama")
    original = {n: m.weight.detach().clone() for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    fakes = qat.init_rtn(model, scheme, (), lr_in_steps=lr_in_steps)  # wraps, then snaps codes the unit moved
    assert len(fakes) == 14
    for name, f in fakes.items():
        w = original[name]
        assert torch.allclose(f.weight, w, rtol=1e-6, atol=0)  # the unit divides out
        scale, zero = compute_qparams(w, scheme)
        rtn = dequantize(quantize(w, scale, zero, scheme), scale, zero, scheme)
        assert torch.equal(f.fake_weight().detach(), rtn)


def test_lr_in_steps_moves_each_weight_by_lr_grid_steps():
    """Adam's first step moves each parameter by lr (times sign(grad)); in grid steps that is lr x scale."""
    lr = 1e-3
    moved = []
    for lr_in_steps in (False, True):
        f = _fake(lr_in_steps=lr_in_steps)
        with torch.no_grad():
            f.log_scale[:, 1] += 2.0  # the second group's grid step is e^2 times the first's
            f.set_weight(f.weight)
        w0 = f.weight.detach().clone()
        opt = torch.optim.Adam([f.latent], lr=lr)
        (f(torch.randn(8, 80)) ** 2).sum().backward()
        opt.step()
        step = (f.weight.detach() - w0).abs()
        moved.append(step[step > 0])
        if lr_in_steps:
            unit = f.unit.repeat_interleave(32, dim=1)[:, :80]
            assert torch.allclose(step[step > 0], (lr * unit)[step > 0], rtol=1e-3)
    assert torch.allclose(moved[0], torch.full_like(moved[0], lr), rtol=1e-3)


@pytest.mark.parametrize("lr_in_steps", [False, True])
@pytest.mark.parametrize("scheme", [Scheme(4, 32), Scheme(4, 32, sym=True), Scheme(2, 64)], ids=str)
def test_frozen_quantlinear_equals_trained_fake_weight_exactly(scheme, lr_in_steps):
    f = _fake(scheme=scheme, learn_zero=True, lr_in_steps=lr_in_steps)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # stand-in for training: move weights, scales and zeros off their init
        f.set_weight(f.weight + torch.randn(f.weight.shape, generator=g) * 0.01)
        f.log_scale.add_(torch.randn(f.log_scale.shape, generator=g) * 0.2)
        if f.zero is not None:
            f.zero.add_(torch.randn(f.zero.shape, generator=g) * 0.7)
    ql = f.freeze()
    assert isinstance(ql, QuantLinear)
    assert torch.equal(ql.dequantized_weight(torch.float32), f.fake_weight().detach())
    x = torch.randn(5, 80)
    with torch.no_grad():
        assert torch.equal(ql(x), f(x))


def test_cosine_schedule_warms_up_then_decays_to_zero():
    f = [cosine_factor(s, 100, 0.1) for s in range(100)]
    assert f[0] < f[5] < f[9] <= 1.0
    assert all(a >= b for a, b in zip(f[10:], f[11:]))
    assert f[-1] < 0.01


def test_qat_lowers_the_loss_and_reloads_identically(tmp_path):
    base = tiny_model("llama")
    held = torch.cat(_batches(n=8, seed=5))
    rtn = copy.deepcopy(base)
    quantize_model(rtn, QuantizeConfig(method="rtn", bits=3, group_size=32))
    model = copy.deepcopy(base)
    seen = []
    cfg = QuantizeConfig.from_flat(method="qat", bits=3, group_size=32, steps=25, lr=1e-4, scale_lr=1e-2, batch_size=4,
                         train_dtype="float32")
    report = quantize_model(model, cfg, _batches(n=16), train_progress=lambda *a: seen.append(a))
    assert [s[:2] for s in seen] == [(i, 25) for i in range(1, 26)] and all(s[2] >= 0 for s in seen)
    assert report.notes.qat.modules == 14
    assert evaluate_kl(model, base, held) < 0.8 * evaluate_kl(rtn, base, held)
    assert not any(isinstance(m, qat.FakeQuantLinear) for m in model.modules())
    qc = build_quantization_config(model, cfg.method, cfg.scheme)
    save_quantized(model, None, tmp_path / "q", qc)
    again = load_quantized(tmp_path / "q")
    ids = held[:2]
    with torch.no_grad():
        assert torch.equal(again(ids).logits, model(ids).logits)


@pytest.mark.parametrize("family", FAMILIES)
def test_qat_on_every_family_gives_the_ptq_checkpoint_format(family, tmp_path):
    model = tiny_model(family)
    cfg = QuantizeConfig.from_flat(method="qat", bits=4, group_size=32, steps=2, batch_size=4, train_dtype="float32")
    quantize_model(model, cfg, _batches(n=4))
    qmods = quantized_modules(model)
    assert len(qmods) == (4 if family == "phi3" else 7) * model.config.num_hidden_layers  # Phi-3: qkv, gate_up fused
    assert not any(p.requires_grad for p in model.parameters())
    save_quantized(model, None, tmp_path / "q", build_quantization_config(model, "qat", cfg.scheme))
    again = load_quantized(tmp_path / "q")
    ids = _batches(seed=3)[0]
    with torch.no_grad():
        assert torch.equal(again(ids).logits, model(ids).logits)


def _init_against_ptq(base, ptq_cfg: QuantizeConfig, lr_in_steps: bool = False):
    """QAT's init from ``ptq_cfg``'s method, checked to equal that method run alone: logits and codes."""
    batches = _batches(n=4)
    ptq_model = copy.deepcopy(base)
    quantize_model(ptq_model, ptq_cfg.replace(fallback=False), batches)  # QAT's init fits on every window
    model = copy.deepcopy(base)
    fakes = qat.init_ptq(model, ptq_cfg.replace(method="qat", init=ptq_cfg.method, lr_in_steps=lr_in_steps), batches,
                         METHODS[ptq_cfg.method])
    assert len(fakes) == 14
    ids = _batches(seed=4)[0]
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ptq_model(ids).logits)
    for name, f in fakes.items():
        ref = ptq_model.get_submodule(name)
        assert torch.equal(f.quantized_weight().q, ref.codes())
        assert torch.equal(f.fake_weight(), ref.quantized_weight().dequantize())
    return model, fakes


def test_awq_init_starts_from_the_awq_result():
    base = tiny_model("llama")
    with torch.no_grad():
        for layer in base.model.layers:
            layer.input_layernorm.weight[:4] *= 20
    model, _ = _init_against_ptq(base, QuantizeConfig.from_flat(method="awq", bits=4, group_size=32,
                                                                search_tokens=128, grid=8))
    # the latent weights are AWQ's smoothed ones (the norm was divided, the columns multiplied)
    q = model.model.layers[0].self_attn.q_proj
    assert not torch.allclose(q.weight, base.model.layers[0].self_attn.q_proj.weight)


@pytest.mark.parametrize("family,lr_in_steps", [("llama", False), ("qwen2", False), ("llama", True)])
def test_gptq_init_starts_from_the_gptq_result(family, lr_in_steps):
    _, fakes = _init_against_ptq(tiny_model(family), QuantizeConfig.from_flat(
        method="gptq", bits=4, group_size=32, act_order=True, static_groups=True, mse=True, guided=True,
        guided_mix=0.5, sequential=False), lr_in_steps)
    for f in fakes.values():
        # the latent weights are GPTQ's pre-rounding ones: off the grid, within half a step of their code
        off = (f.weight - f.fake_weight()).abs() / f.qparams()[0].repeat_interleave(32, dim=1)
        assert off.max() <= 0.5 + 1e-4 and off.mean() > 0.1


def test_qat_from_gptq_trains_and_freezes_to_what_it_trained():
    model = tiny_model("llama")
    cfg = QuantizeConfig.from_flat(method="qat", init="gptq", bits=4, group_size=32, steps=3, lr=1e-3,
                                   act_order=True, static_groups=True, train_dtype="float32")
    start = copy.deepcopy(model)
    quantize_model(start, cfg.replace(method="gptq", steps=None), _batches(n=4))
    res = qat.train(model, cfg, _batches(n=4), ptq=METHODS["gptq"])
    assert res.init == "gptq" and res.modules == 14 and len(res.train.losses) == 3
    moved = [not torch.equal(model.get_submodule(n).codes(), start.get_submodule(n).codes()) for n, m in
             start.named_modules() if isinstance(m, QuantLinear)]
    assert any(moved)  # training changed some codes from GPTQ's


def test_qat_without_calibration_data_is_a_clear_error():
    with pytest.raises(ValueError, match="needs calibration data"):
        quantize_model(tiny_model("llama"), QuantizeConfig.from_flat(method="qat", steps=2), None)
    with pytest.raises(ValueError, match="calibration text"):
        qat.train(tiny_model("llama"), QuantizeConfig.from_flat(method="qat", steps=2), [])


@pytest.mark.parametrize("field,value,msg", [
    ("init", "nf4", "init='nf4' is unknown"),
    ("steps", 0, "steps=0"),
    ("lr", 0.0, "lr=0.0"),
    ("train_dtype", "float16", "train_dtype='float16'"),
])
def test_bad_qat_options(field, value, msg):
    with pytest.raises(ValueError, match=msg):
        QuantizeConfig.from_flat(method="qat", **{field: value})


@pytest.mark.parametrize("fields,msg", [
    ({"init": "gptq", "act_order": True}, "needs static_groups"),
    ({"init": "awq", "act_order": True, "static_groups": True}, "act_order applies to method gptq"),
    ({"init": "awq", "sequential": False}, "sequential: false applies"),
    ({"init": "rtn", "weighted_range": True}, "AWQ or GPTQ init only"),
])
def test_gptq_options_need_qat_init_gptq(fields, msg):
    with pytest.raises(ValueError, match=msg):
        QuantizeConfig.from_flat(method="qat", **fields)
    if fields["init"] == "gptq":
        QuantizeConfig.from_flat(method="qat", **{**fields, "static_groups": True})


def test_cli_qat(tmp_path, calib_text, smol_tokenizer):
    from click.testing import CliRunner

    from cli import main

    model_dir = tmp_path / "tiny"
    tiny_model("llama", vocab=len(smol_tokenizer)).save_pretrained(model_dir)
    smol_tokenizer.save_pretrained(model_dir)
    args = ["quantize", "--recipe", "qat4", "--model", model_dir, "--calib", calib_text, "--nsamples", 4,
            "--seqlen", 32, "--group-size", 32, "--steps", 2, "--lr", 1e-4, "--init", "rtn", "--out", tmp_path / "q"]
    res = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    assert "qat: 2 steps from rtn, KL" in res.output
    qc = __import__("json").loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    assert qc["method"] == "qat" and len(qc["modules"]) == 14 and qc["config"]["steps"] == 2


def test_a_ptq_init_without_its_method_is_a_clear_error():
    with pytest.raises(ValueError, match="init: awq needs that method's adapter"):
        qat.train(tiny_model("llama"), QuantizeConfig.from_flat(method="qat", init="awq", steps=2), _batches(n=2))
