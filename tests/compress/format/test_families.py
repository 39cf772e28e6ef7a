"""Every family of compress/format/families.py end to end on its tiny model: the bundled rtn4, gptq4 and awq4 recipes
quantize it, the folder reloads (through compress.format.models.load_model, as every command does) to identical
logits, and AWQ's smoothing map leaves the fp function unchanged. The exports of these folders are checked
per family in tests/compress/exporters/test_families.py."""
from __future__ import annotations

import copy

import pytest
import torch
from tiny_models import FAMILIES, MOE_FAMILIES, one_thread, quantize_tiny, tiny_config, token_batches

from compress.format.families import FAMILIES as TABLE
from compress.format.families import supports
from compress.format.moe_packed import PackedMoEExperts

RECIPES = ("rtn4", "gptq4", "awq4")
IDS = token_batches(2, 12, seed=1)[0]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with one_thread():
        yield


def logits(model, ids: torch.Tensor = IDS) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("family", FAMILIES + MOE_FAMILIES)
def test_recipe_quantizes_saves_and_reloads_to_identical_logits(family, recipe, tmp_path):
    from compress.format.checkpoint import quantized_modules
    from compress.format.models import load_model

    base, model = quantize_tiny(family, recipe, tmp_path / "q")
    ref, out = logits(base), logits(model)
    assert torch.isfinite(out).all()
    assert (out - ref).norm() / ref.norm() < 0.5
    qmods = quantized_modules(model)
    fp_left = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in n]
    assert qmods and all(n.endswith(("mlp.gate", "shared_expert_gate")) for n in fp_left)  # MoE routers stay fp
    packed = [m for m in model.modules() if isinstance(m, PackedMoEExperts)]
    assert len(packed) == (model.config.num_hidden_layers if family in MOE_FAMILIES else 0)
    again, _, src = load_model(str(tmp_path / "q"))
    assert src.quantized and set(quantized_modules(again)) == set(qmods)
    assert torch.equal(logits(again), out)


def smooth_randomly(model: torch.nn.Module, seed: int = 0) -> int:
    """Apply a random per-channel scale to every smoothing of the family's AWQ map, as AWQ applies its searched
    ones (the op before divided, the linears' columns multiplied); returns how many were applied."""
    from compress.calibrate import decoder_layers

    bmap = TABLE[model.config.model_type].smooth
    gen = torch.Generator().manual_seed(seed)
    n = 0
    with torch.no_grad():
        for block in decoder_layers(model):
            for sm in bmap.smooths:
                prev, lins = block.get_submodule(sm.prev), [block.get_submodule(n) for n in sm.linears]
                width = prev.weight.shape[0]
                if any(m.in_features != width for m in lins):  # v_proj -> o_proj under GQA: AWQ skips it too
                    continue
                s = torch.rand(width, generator=gen) * 3 + 0.25
                if isinstance(prev, torch.nn.Linear):
                    prev.weight.div_(s[:, None])
                    if prev.bias is not None:
                        prev.bias.div_(s)
                else:  # a norm computing (offset + w) * x_hat
                    prev.weight.copy_((bmap.norm_offset + prev.weight) / s - bmap.norm_offset)
                for m in lins:
                    m.weight.mul_(s)
                n += 1
    return n


@pytest.mark.parametrize("family", [f for f in FAMILIES + MOE_FAMILIES if supports(f, "awq")])
def test_the_smoothing_map_leaves_the_fp_function_unchanged(family):
    """Checks each family's map against transformers' modeling code: a norm or linear that is not what feeds
    the listed linears (a post-norm, a fused split, a q/k norm in between) changes the logits."""
    import transformers as tf

    cfg = tiny_config(family)
    cfg.num_key_value_heads = cfg.num_attention_heads  # MHA, so that v_proj -> o_proj is smoothed as well
    torch.manual_seed(0)
    base = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in base.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model = copy.deepcopy(base)
    applied = smooth_randomly(model)
    assert applied == len(TABLE[family].smooth.smooths) * cfg.num_hidden_layers
    ref, out = logits(base), logits(model)
    assert (out - ref).abs().max() <= 1e-5 * ref.abs().max()  # fp32 rounding (RMSNorms compute in fp32 anyway)
    assert any((a - b).abs().max() > 1e-3 for a, b in zip(base.parameters(), model.parameters()))


@pytest.mark.parametrize("family", FAMILIES + MOE_FAMILIES)
def test_every_family_is_in_the_table(family):
    assert family in TABLE and TABLE[family].smooth is not None
