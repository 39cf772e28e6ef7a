"""The runtime's sparse MoE block (runtime/models/moe.py) against transformers' (fp32, every MoE family)."""
import copy

import pytest
import torch

from compress.config import QuantizeConfig
from compress.format.families import FAMILIES
from compress.format.moe_packed import PackedLinears
from compress.methods.common import moe as cmoe
from runtime.kernels.moe import StackedLinears
from runtime.models.loader import Checkpoint, build_model
from runtime.models.moe import SparseMoE, route
from tiny_engine import save_tiny
from tiny_models import MOE_FAMILIES, NUM_EXPERTS, tiny_config

VARIANTS = [(f, {}) for f in MOE_FAMILIES] + [
    ("qwen3_moe", {"norm_topk_prob": True}), ("olmoe", {"norm_topk_prob": True}),
    ("mixtral", {"norm_topk_prob": False}),  # Mixtral renormalizes whatever the config says
    ("qwen2_moe", {"norm_topk_prob": True}),
]


def hf_moe(family: str, overrides: dict, experts_implementation: str = "eager", seed: int = 0, layers: int = 2):
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(family, layers=layers)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    cfg._experts_implementation = experts_implementation
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():  # experts and routers that matter: larger than the init's 0.02
        for name, p in model.named_parameters():
            if p.dim() >= 2 and "embed" not in name:
                p.normal_(0, 0.15)
    return model


def runtime_model(hf):
    ckpt = Checkpoint("hf", hf.config.to_dict(), dict(hf.state_dict()))  # transformers 5's fused expert tensors
    return build_model(ckpt, torch.float32, 64)


def _x(seed: int = 1, tokens: int = 19):
    return torch.randn(tokens, 64, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family,overrides", VARIANTS, ids=lambda v: str(v).replace(" ", ""))
def test_block_equals_transformers_eager(family, overrides):
    hf = hf_moe(family, overrides)
    ours = runtime_model(hf)
    x = _x()
    with torch.no_grad():
        for i in range(hf.config.num_hidden_layers):
            ref = hf.model.layers[i].mlp(x[None])[0]
            assert isinstance(ours.layers[i].mlp, SparseMoE)
            # fp32 rounding only: the expert matmuls may take other kernels than transformers' on some CPUs
            torch.testing.assert_close(ours.layers[i].mlp(x), ref, rtol=1e-5, atol=1e-5, msg=f"layer {i}")


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_block_close_to_transformers_grouped_mm(family):
    hf = hf_moe(family, {}, experts_implementation="grouped_mm")
    ours = runtime_model(hf)
    x = _x(2)
    with torch.no_grad():
        torch.testing.assert_close(ours.layers[0].mlp(x), hf.model.layers[0].mlp(x[None])[0], rtol=1e-5, atol=1e-5)


def test_routing_renormalizes_only_when_asked():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    plain, renorm = route(logits, 2, False), route(logits, 2, True)
    probs = logits.softmax(-1)
    assert plain.index.tolist() == [[0, 1]] and torch.allclose(plain.weights, probs[:, :2])
    assert torch.allclose(renorm.weights.sum(-1), torch.ones(1))
    assert plain.weights.dtype == renorm.weights.dtype == torch.float32


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_hub_per_expert_layout_loads_the_same_experts(family, tmp_path):
    """save_pretrained writes per-expert tensors (Mixtral: block_sparse_moe.experts.{e}.w1/w2/w3); they stack
    into exactly transformers' fused gate_up_proj/down_proj."""
    from runtime.models.loader import open_checkpoint

    hf = save_tiny(family, tmp_path)
    ckpt = open_checkpoint(str(tmp_path))
    assert not any(".experts.gate_up_proj" in k for k in ckpt.tensors), "expected the per-expert layout on disk"
    ours = build_model(ckpt, torch.float32, 64).layers[1].mlp
    ref = hf.model.layers[1].mlp
    assert isinstance(ours.gate_up_proj, StackedLinears)
    assert torch.equal(ours.gate_up_proj.weight, ref.experts.gate_up_proj)
    assert torch.equal(ours.down_proj.weight, ref.experts.down_proj)
    assert torch.equal(ours.router, ref.gate.weight)


def test_qwen_moe_dense_layers_follow_mlp_only_layers_and_sparse_step():
    hf = hf_moe("qwen2_moe", {"mlp_only_layers": [0]}, layers=3)
    ours = runtime_model(hf)
    assert [isinstance(layer.mlp, SparseMoE) for layer in ours.layers] == [False, True, True]
    hf2 = hf_moe("qwen3_moe", {"decoder_sparse_step": 2}, layers=4)
    assert [isinstance(layer.mlp, SparseMoE) for layer in runtime_model(hf2).layers] == [False, True, False, True]
    x = _x(3)
    with torch.no_grad():
        assert torch.equal(ours.layers[0].mlp(x), hf.model.layers[0].mlp(x[None])[0])


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_packed_experts_block_equals_transformers_with_compress_packed_experts(family):
    """Experts quantized by compress (RTN) stay packed in the runtime and give the same block output as
    transformers' block holding compress's PackedMoEExperts (the torch quantized model)."""
    hf = hf_moe(family, {})
    layout = FAMILIES[family].experts
    for i, layer in enumerate(hf.model.layers):
        cmoe.quantize_block_experts(i, layer, layout, QuantizeConfig(method="rtn", bits=4, group_size=32))
    qc = cmoe.moe_entries(hf)
    ckpt = Checkpoint("q", hf.config.to_dict(), dict(hf.state_dict()), quant_experts=qc)
    ours = build_model(ckpt, torch.float32, 64)
    assert isinstance(ours.layers[0].mlp.gate_up_proj, PackedLinears)
    assert ours.layers[0].mlp.gate_up_proj.qweight.dtype == torch.int32  # no fp copy made at load
    x = _x(4)
    with torch.no_grad():
        assert torch.equal(ours.layers[0].mlp(x), hf.model.layers[0].mlp(x[None])[0])


def test_mismatched_moe_entry_is_a_clear_error():
    hf = hf_moe("mixtral", {})
    layout = FAMILIES["mixtral"].experts
    cmoe.quantize_block_experts(0, hf.model.layers[0], layout, QuantizeConfig(method="rtn", bits=4, group_size=32))
    entry = copy.deepcopy(cmoe.moe_entries(hf)["model.layers.0.mlp.experts"])
    entry["num_experts"] = NUM_EXPERTS + 1
    experts = {"model.layers.0.mlp.experts": entry}
    ckpt = Checkpoint("q", hf.config.to_dict(), dict(hf.state_dict()), quant_experts=experts)
    with pytest.raises(ValueError, match="records \\(experts, hidden, intermediate\\)"):
        build_model(ckpt, torch.float32, 64)


def test_missing_experts_are_a_clear_error():
    hf = hf_moe("olmoe", {})
    tensors = {k: v for k, v in hf.state_dict().items() if "layers.1.mlp.experts" not in k}
    with pytest.raises(ValueError, match="no experts for model.layers.1.mlp"):
        build_model(Checkpoint("broken", hf.config.to_dict(), tensors), torch.float32, 64)


def test_router_stays_fp32_in_a_bfloat16_model():
    hf = hf_moe("qwen3_moe", {})
    ours = build_model(Checkpoint("hf", hf.config.to_dict(), dict(hf.state_dict())), torch.bfloat16, 64)
    block = ours.layers[0].mlp
    assert block.router.dtype == torch.float32 and block.gate_up_proj.weight.dtype == torch.bfloat16
    x = _x(5)
    with torch.no_grad():
        ref = hf.model.layers[0].mlp(x[None])[0]
        out = block(x.bfloat16())
    assert out.dtype == torch.bfloat16 and (out.float() - ref).norm() / ref.norm() < 2e-2


def test_top_k_beyond_the_experts_is_a_clear_error():
    from runtime.models.llama import ModelConfig

    cfg = tiny_config("olmoe").to_dict()
    cfg["num_experts_per_tok"] = NUM_EXPERTS + 1
    with pytest.raises(ValueError, match=f"num_experts_per_tok={NUM_EXPERTS + 1} must be in 1..num_experts=4"):
        ModelConfig.from_hf(cfg)
