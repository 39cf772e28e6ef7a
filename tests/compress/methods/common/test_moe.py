import copy
import logging

import pytest
import torch
from tiny_models import MOE_FAMILIES, NUM_EXPERTS, tiny_config, tiny_model

from compress.calibrate import decoder_layers
from compress.config import QuantizeConfig
from compress.format import quant
from compress.format.checkpoint import build_quantization_config, load_quantized, save_quantized
from compress.format.families import FAMILIES
from compress.format.moe_packed import PackedLinears, PackedMoEExperts, packed_moe_forward
from compress.format.qlinear import QuantLinear
from compress.format.quant import Scheme
from compress.methods.common import moe
from compress.methods.common.report import ExpertRecord
from compress.pipeline import quantize_model

E = NUM_EXPERTS


def moe_model(family: str, seed: int = 0, experts_implementation: str | None = None):
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(family)
    if experts_implementation:
        cfg._experts_implementation = experts_implementation
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():  # a router that actually prefers some experts, and non-trivial norms
        for n, p in model.named_parameters():
            if n.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5)
            elif "norm" in n:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def _batches(n=8, seqlen=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return list(torch.randint(0, 256, (n, seqlen), generator=g).split(4))


def _expert_weights(seed=0, out_f=48, in_f=64, scheme=Scheme(4, 32)):
    g = torch.Generator().manual_seed(seed)
    return [quant.quantize_weight(torch.randn(out_f, in_f, generator=g) * 0.05, scheme) for _ in range(E)]


def _routing(T=24, k=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    index = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    weights = torch.rand(T, k, generator=g).softmax(-1)
    return index, weights


@pytest.mark.parametrize("scheme", [Scheme(4, 32), Scheme(4, 32, sym=True), Scheme(3, 24), Scheme(8, -1, sym=True)],
                         ids=str)
def test_pack_unpack_round_trip(scheme):
    qws = _expert_weights(scheme=scheme)
    packed = PackedLinears.from_quantized(qws)
    assert packed.qweight.shape[:2] == (E, 48) and packed.qweight.dtype == torch.int32
    assert packed.scales.shape == (E, 48, scheme.n_groups(64)) and packed.scales.dtype == torch.float16
    assert (packed.qzeros is not None) == scheme.has_zeros
    for e, qw in enumerate(qws):
        back = packed.quantized_weight(e)
        assert torch.equal(back.q, qw.q) and torch.equal(back.scale, qw.scale)
        assert (qw.zero is None) or torch.equal(back.zero, qw.zero)
        assert torch.equal(packed.expert_weight(e), qw.dequantize())


def test_packed_forward_equals_the_unpacked_quantized_experts():
    gu, dn = _expert_weights(0, 2 * 48, 64), _expert_weights(1, 64, 48)
    experts = PackedMoEExperts(PackedLinears.from_quantized(gu), PackedLinears.from_quantized(dn), torch.nn.SiLU())
    x = torch.randn(24, 64)
    index, weights = _routing()
    index[3, 1] = E  # a masked slot (transformers' expert-parallel padding index) contributes nothing
    with torch.no_grad():
        out = experts(x, index, weights)
        ref = torch.zeros_like(x)  # the same integers through one QuantLinear per expert, token by token
        for t in range(x.shape[0]):
            for slot in range(2):
                e = index[t, slot].item()
                if e >= E:
                    continue
                g, u = QuantLinear.from_quantized(gu[e])(x[t]).chunk(2)
                ref[t] += QuantLinear.from_quantized(dn[e])(torch.nn.functional.silu(g) * u) * weights[t, slot]
    assert torch.allclose(out, ref, atol=1e-5, rtol=1e-5)
    experts.cache_weight()
    assert torch.equal(experts(x, index, weights), out)


@pytest.mark.parametrize("impl", ["eager", None])
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_packed_block_matches_transformers_block_with_dequantized_weights(family, impl):
    model = moe_model(family, experts_implementation=impl)
    block = decoder_layers(model)[0]
    ref_block = copy.deepcopy(block)
    layout = FAMILIES[family].experts
    moe.quantize_block_experts(0, block, layout, QuantizeConfig(method="rtn", bits=4, group_size=32))
    packed = block.get_submodule(layout.experts)
    assert isinstance(packed, PackedMoEExperts)
    orig = ref_block.get_submodule(layout.experts)
    with torch.no_grad():
        orig.gate_up_proj.copy_(torch.stack([packed.gate_up_proj.expert_weight(e) for e in range(E)]))
        orig.down_proj.copy_(torch.stack([packed.down_proj.expert_weight(e) for e in range(E)]))
        h = torch.randn(2, 16, 64)
        out, ref = block.mlp(h), ref_block.mlp(h)
    assert torch.allclose(out, ref, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("method", ["rtn", "gptq", "awq"])
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_moe_families_quantize_pack_and_reload(family, method, tmp_path):
    base = moe_model(family)
    model = copy.deepcopy(base)
    cfg = QuantizeConfig.from_flat(method=method, bits=4, group_size=32, search_tokens=256, moe_min_tokens=8)
    report = quantize_model(model, cfg, _batches())
    assert not [n for n, p in model.named_parameters() if p.ndim == 3], "experts left in fp"
    for layer in decoder_layers(model):
        assert isinstance(layer.mlp.experts, PackedMoEExperts)
        assert isinstance(layer.mlp.gate.weight, torch.nn.Parameter)  # the router stays fp
        assert isinstance(layer.self_attn.q_proj, QuantLinear)
    expert_records = [r for r in report.layers if isinstance(r, ExpertRecord)]
    assert len(expert_records) == 2 * E
    if method != "rtn":
        assert all(r.tokens >= 8 and not r.fallback for r in expert_records)
    ids = _batches(seed=3)[0]
    with torch.no_grad():
        ref, out = base(ids).logits, model(ids).logits
    assert torch.isfinite(out).all()
    assert (out - ref).norm() / ref.norm() < 0.3
    qc = build_quantization_config(model, cfg.method, cfg.scheme)
    assert set(qc["moe"]) == {f"model.layers.{i}.mlp.experts" for i in range(2)}
    entry = qc["moe"]["model.layers.0.mlp.experts"]
    assert entry["num_experts"] == E and entry["bits"] == 4 and entry["rtn_fallback"] == []
    save_quantized(model, None, tmp_path / "q", qc)
    again = load_quantized(tmp_path / "q")
    assert isinstance(again.model.layers[1].mlp.experts, PackedMoEExperts)
    with torch.no_grad():
        assert torch.equal(again(ids).logits, out)


def _expert_error(model, base, layer=0):
    """Output MSE of one layer's experts against fp on that layer's routed inputs."""
    routed = moe.RoutedInputs()
    fp_experts = decoder_layers(base)[layer].mlp.experts
    h = fp_experts.register_forward_pre_hook(routed.hook, with_kwargs=True)
    with torch.no_grad():
        base(torch.cat(_batches(seed=9)))
    h.remove()
    x, idx = routed.hidden[0], routed.index[0]
    w = torch.full(idx.shape, 0.5)
    with torch.no_grad():
        return (decoder_layers(model)[layer].mlp.experts(x, idx, w) - fp_experts(x, idx, w)).pow(2).mean().item()


def test_gptq_experts_beat_rtn_on_routed_tokens():
    base = moe_model("mixtral")
    errs = {}
    for method in ("rtn", "gptq"):
        model = copy.deepcopy(base)
        quantize_model(model, QuantizeConfig(method=method, bits=3, group_size=32, moe_min_tokens=8), _batches(n=16))
        errs[method] = _expert_error(model, base)
    assert errs["gptq"] < errs["rtn"]


def test_dead_expert_falls_back_to_rtn_with_a_warning(caplog):
    base = moe_model("mixtral")
    model = copy.deepcopy(base)

    def never_expert_0(module, args, out):  # reroute every choice of expert 0 to expert 1
        logits, scores, index = out
        return logits, scores, torch.where(index == 0, torch.ones_like(index), index)

    for layer in decoder_layers(model):
        layer.mlp.gate.register_forward_hook(never_expert_0)
    cfg = QuantizeConfig(method="gptq", bits=4, group_size=32)
    with caplog.at_level(logging.WARNING, logger="compress.methods.common.moe"):
        report = quantize_model(model, cfg, _batches())
    assert "fewer than 32 routed calibration tokens {0: 0}" in caplog.text
    packed = model.model.layers[0].mlp.experts
    assert packed.rtn_fallback == [0]
    w_gu = base.model.layers[0].mlp.experts.gate_up_proj.data[0]
    assert torch.equal(packed.gate_up_proj.quantized_weight(0).q, quant.quantize_weight(w_gu, cfg.scheme).q)
    rec = [r for r in report.layers if isinstance(r, ExpertRecord) and r.expert == 0 and r.layer == 0][0]
    assert rec.fallback and rec.tokens == 0
    for e in range(E):
        assert torch.isfinite(packed.gate_up_proj.expert_weight(e)).all()
        assert torch.isfinite(packed.down_proj.expert_weight(e)).all()
    with torch.no_grad():
        assert torch.isfinite(model(_batches(seed=2)[0]).logits).all()
    qc = build_quantization_config(model, "gptq", cfg.scheme)
    assert qc["moe"]["model.layers.0.mlp.experts"]["rtn_fallback"] == [0]


def test_gptq_act_order_experts_keep_their_column_groups(tmp_path):
    model = moe_model("qwen2_moe")
    cfg = QuantizeConfig.from_flat(method="gptq", bits=4, group_size=16, act_order=True, moe_min_tokens=8)
    quantize_model(model, cfg, _batches())
    packed = model.model.layers[0].mlp.experts
    assert packed.gate_up_proj.g_idx is not None and packed.gate_up_proj.g_idx.shape == (E, 64)
    save_quantized(model, None, tmp_path / "q", build_quantization_config(model, "gptq", cfg.scheme, True))
    again = load_quantized(tmp_path / "q")
    ids = _batches(seed=3)[0]
    with torch.no_grad():
        assert torch.equal(again(ids).logits, model(ids).logits)


def test_moe_options_on_a_dense_model_are_an_error():
    with pytest.raises(ValueError, match="moe_min_tokens=8 applies to mixture-of-experts models, and 'llama' is dense"):
        quantize_model(tiny_model("llama"), QuantizeConfig(method="rtn", moe_min_tokens=8))
    with pytest.raises(ValueError, match="moe_min_tokens=0"):
        QuantizeConfig(moe_min_tokens=0)


def test_unsupported_moe_inputs_are_clear_errors():
    model = moe_model("mixtral")
    with pytest.raises(ValueError, match="method qat does not train mixture-of-experts"):
        quantize_model(model, QuantizeConfig.from_flat(method="qat", steps=2), _batches())
    model.config.model_type = "mymoe"
    with pytest.raises(ValueError, match="'mymoe' keeps fused 3D expert weights"):
        quantize_model(model, QuantizeConfig(method="rtn"))


def test_model_type_without_awq_mapping_is_a_clear_error():
    model = tiny_model("llama")
    model.config.model_type = "mystery"
    with pytest.raises(ValueError, match="does not handle model_type 'mystery'"):
        quantize_model(model, QuantizeConfig(method="awq"), _batches())


@pytest.mark.parametrize("method", ["rtn", "gptq", "awq"])
def test_experts_named_by_ignore_stay_fp_and_reload(method, tmp_path):
    base = moe_model("qwen2_moe")
    model = copy.deepcopy(base)
    cfg = QuantizeConfig.from_flat(method=method, bits=4, group_size=32, search_tokens=256, moe_min_tokens=8,
                                   ignore=("lm_head", r"layers\.0\.mlp\.experts$"))
    quantize_model(model, cfg, _batches())
    layers = decoder_layers(model)
    assert not isinstance(layers[0].mlp.experts, PackedMoEExperts)
    assert torch.equal(layers[0].mlp.experts.gate_up_proj, decoder_layers(base)[0].mlp.experts.gate_up_proj)
    assert all(isinstance(layer.mlp.experts, PackedMoEExperts) for layer in layers[1:])
    qc = build_quantization_config(model, method, cfg.scheme)
    assert "model.layers.0.mlp.experts" not in qc["moe"] and "model.layers.1.mlp.experts" in qc["moe"]
    save_quantized(model, None, tmp_path / "q", qc)
    ids = _batches(seed=3)[0]
    with torch.no_grad():
        assert torch.equal(load_quantized(tmp_path / "q")(ids).logits, model(ids).logits)
