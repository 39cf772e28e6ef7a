import copy

import pytest
import torch
from tiny_models import tiny_model

from compress.calibrate import capture_inputs, decoder_layers
from compress.config import QuantizeConfig
from compress.methods.common import gptq_solver
from compress.methods.common import guided
from compress.methods.common.guided import token_weights
from compress.pipeline import quantize_model

BATCHES = list(torch.randint(0, 256, (4, 12), generator=torch.Generator().manual_seed(0)).split(2))


def test_weights_are_the_squared_loss_gradient_at_each_output():
    model = tiny_model("llama", layers=2)
    tw = token_weights(model, BATCHES)
    assert set(tw) == {(i, n) for i in range(2) for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                                          "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
                                                          "mlp.down_proj")}
    assert all(p.grad is None and p.requires_grad for p in model.parameters())  # nothing trained, flags restored
    # by hand, in float32 (the pass runs in bfloat16: the weights agree to its rounding)
    outs = []
    lin = decoder_layers(model)[1].mlp.down_proj

    def keep(module, args, out):
        out.retain_grad()
        outs.append(out)
    h = lin.register_forward_hook(keep)
    raw = []
    for ids in BATCHES:
        outs.clear()
        model.get_input_embeddings().weight.requires_grad_(True)
        logits = model(input_ids=ids).logits
        torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(), reduction="sum").backward()
        raw.append(outs[0].grad.pow(2).sum(-1))
    h.remove()
    want = torch.stack(raw) / torch.stack(raw).mean()
    got = torch.stack(tw[(1, "mlp.down_proj")])
    assert got.shape == (2, 2, 12) and torch.allclose(got.mean(), torch.tensor(1.0))
    assert torch.allclose(got, want, rtol=0.1, atol=0.02)
    assert (got[..., -1] == 0).all()  # the last position predicts nothing


def test_weights_held_as_bfloat16_give_the_same_token_weights_and_come_back_exactly():
    """A model whose linear weights are bfloat16 values (read from bfloat16 shards) runs the pass on bfloat16 copies
    of them: the same numbers as autocast's casts, and every weight restored bit for bit, as float32."""
    model = tiny_model("llama", layers=2)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.bfloat16().float())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    want = token_weights(copy.deepcopy(model), BATCHES)
    lin = guided.quantized_linears(model)
    up = lin[(0, "mlp.up_proj")].weight
    kept = up.data[0, 0].item()
    up.data[0, 0] = kept + 1e-6  # a value that bfloat16 would round: that weight stays float32
    with guided.bfloat16_weights(lin) as n:
        assert n == len(lin) - 1 and up.dtype == torch.float32
        assert lin[(1, "mlp.down_proj")].weight.dtype == torch.bfloat16
    assert all(m.weight.dtype == torch.float32 for m in lin.values())
    up.data[0, 0] = kept
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    got = token_weights(model, BATCHES)
    assert all(torch.equal(a, b) for k in want for a, b in zip(got[k], want[k]))


def test_weighted_hessian_counts_each_token_by_its_weight():
    x = torch.randn(2, 5, 8)
    w = torch.rand(2, 5)
    h = gptq_solver.Hessian.zeros(8)
    h.add(x, w)
    flat, fw = x.reshape(-1, 8), w.reshape(-1)
    assert torch.allclose(h.H, 2 * (flat * fw[:, None]).T @ flat / 10, atol=1e-6)


def test_guided_weights_split_the_shared_hessians():
    model = tiny_model("llama", layers=1)
    block = decoder_layers(model)[0]
    inputs = capture_inputs(model, BATCHES)
    lins = {n: block.get_submodule(n) for n in ("self_attn.q_proj", "self_attn.k_proj")}
    shared = gptq_solver.observe(block, lins, inputs)
    assert shared["self_attn.q_proj"] is shared["self_attn.k_proj"]
    tw = token_weights(model, BATCHES)
    split = gptq_solver.observe(block, lins, inputs, {n: tw[(0, n)] for n in lins})
    assert not torch.allclose(split["self_attn.q_proj"].H, split["self_attn.k_proj"].H)
    ones = gptq_solver.observe(block, lins, inputs, {n: [torch.ones(b.shape) for b in BATCHES] for n in lins})
    assert torch.allclose(ones["self_attn.q_proj"].H, shared["self_attn.q_proj"].H, atol=1e-5)


@pytest.mark.parametrize("family, method", [("llama", "gptq"), ("qwen2_moe", "gptq"), ("llama", "awq"),
                                            ("qwen2", "awq")])
def test_guided_gptq_end_to_end(family, method):
    model = tiny_model(family, layers=2)
    extra = {"rounding": "gptq", "grid": 4, "search_tokens": 16} if method == "awq" else {}
    cfg = QuantizeConfig.from_flat(method=method, bits=4, group_size=32, guided=True, act_order=True,
                                   static_groups=True, **extra)
    q = copy.deepcopy(model)
    quantize_model(q, cfg, BATCHES)
    with torch.no_grad():
        ref, out = model(input_ids=BATCHES[0]).logits, q(input_ids=BATCHES[0]).logits
    assert torch.isfinite(out).all() and (out - ref).abs().mean() < ref.abs().mean()


def test_guided_is_refused_where_no_gptq_hessian_reads_it():
    with pytest.raises(ValueError, match="guided applies to method gptq"):
        QuantizeConfig.from_flat(method="awq", guided=True)  # awq rounds by rtn unless rounding: gptq


@pytest.mark.parametrize("family, recipe", [("llama", "guided-gptq4"), ("gemma", "guided-gptq4"),
                                            ("phi3", "guided-gptq4"), ("qwen2", "guided-gptq3"),
                                            ("mistral", "guided-qat4")])
def test_guided_recipe_end_to_end_saved_and_reloaded(family, recipe, tmp_path):
    from compress.config import load_recipe
    from compress.format.checkpoint import build_quantization_config, load_quantized, save_quantized

    cfg = load_recipe(recipe).replace(nsamples=4, seqlen=12, batch_size=2, group_size=32, steps=2)
    base = tiny_model(family, layers=2)
    model = copy.deepcopy(base)
    quantize_model(model, cfg, BATCHES)
    save_quantized(model, None, tmp_path / "q", build_quantization_config(model, cfg.method, cfg.scheme))
    ids = BATCHES[0]
    with torch.no_grad():
        out, again = model(input_ids=ids).logits, load_quantized(tmp_path / "q")(input_ids=ids).logits
    assert torch.equal(out, again)


def test_guided_is_not_streamed():
    from types import SimpleNamespace

    from compress.config import load_recipe
    from compress.job import why_not_streamed

    src = SimpleNamespace(quantized=False)
    assert why_not_streamed(src, load_recipe("guided-gptq4")) == "guided GPTQ backpropagates through the whole model"
    assert why_not_streamed(src, load_recipe("gptq4")) is None
