import copy

import pytest
import torch
from tiny_models import FAMILIES, MOE_FAMILIES, tiny_model, loud_channels

from compress.calibrate import decoder_layers
from compress.format.families import supports
from compress.format.mappings import block_map
from compress.transforms.rotate import residual_map, rotate_model


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def _ids(vocab=256, seed=1):
    return torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(seed))


def _assert_same_function(base, rotated, vocab=256):
    ids = _ids(vocab)
    ref, out = _logits(base, ids), _logits(rotated, ids)
    assert (out - ref).abs().max() <= 1e-5 * ref.abs().max()  # fp32 rounding of a different summation order


ALL = FAMILIES + MOE_FAMILIES


@pytest.mark.parametrize("family", [f for f in ALL if supports(f, "rotate")])
def test_rotated_model_computes_the_same_logits(family):
    base = tiny_model(family)
    model = copy.deepcopy(base)
    report = rotate_model(model, "hadamard", seed=0)
    _assert_same_function(base, model)
    offset = block_map(family).norm_offset
    for block in decoder_layers(model):  # every residual norm is now a plain x / rms(x)
        for norm, _ in block_map(family).residual.reads:
            assert torch.all(block.get_parameter(norm) == 1 - offset)
    q0, q1 = (decoder_layers(m)[0].self_attn.q_proj.weight for m in (base, model))
    assert (q0 - q1).abs().max() > 1e-2  # the weights really moved
    assert report.untied_head == bool(base.config.tie_word_embeddings)  # the tiny norms are not uniform


@pytest.mark.parametrize("hidden", [80, 96])  # Paley orders: 80 = 20 x 4 with heads of 20; 96 = 12 x 8 with heads of 24
def test_widths_that_are_not_powers_of_two(hidden):
    base = tiny_model("llama", hidden=hidden)
    model = copy.deepcopy(base)
    rotate_model(model, "hadamard", seed=5)
    _assert_same_function(base, model)


def test_tied_embeddings_stay_tied_when_the_final_norm_is_uniform():
    base = tiny_model("gemma")
    with torch.no_grad():
        base.model.norm.weight.fill_(0.3)  # Gemma: 1.3 x, which commutes with any rotation
    model = copy.deepcopy(base)
    report = rotate_model(model, "hadamard")
    _assert_same_function(base, model)
    assert not report.untied_head and model.config.tie_word_embeddings
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight


def test_untied_head_is_its_own_matrix_and_the_config_says_so():
    base = tiny_model("gemma")
    model = copy.deepcopy(base)
    report = rotate_model(model, "hadamard")
    assert report.untied_head and report.added_bytes == 256 * 64 * 4
    assert model.get_output_embeddings().weight is not model.get_input_embeddings().weight
    assert model.config.tie_word_embeddings is False


@pytest.mark.parametrize("family", [f for f in ALL if not supports(f, "rotate")])
def test_a_family_that_cannot_be_folded_is_refused_by_name_before_any_change(family):
    model = tiny_model(family)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=rf"does not handle model_type '{family}' \(its ") as e:
        rotate_model(model, "hadamard")
    assert "use rotate: none" in str(e.value) and "llama" in str(e.value)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_a_model_that_does_not_match_its_map_is_refused():
    model = tiny_model("llama")
    del decoder_layers(model)[0].mlp.up_proj
    with pytest.raises(ValueError, match=r"expected weights \['mlp.up_proj.weight'\] are missing"):
        residual_map(model)


def _batches(n=4, seqlen=32, seed=0):
    return list(torch.randint(0, 256, (n * 2, seqlen), generator=torch.Generator().manual_seed(seed)).split(2))


@pytest.mark.parametrize("recipe", ["rot-awq-gptq4", "rot-qat4", pytest.param("rot-gptq4", marks=pytest.mark.slow),
                                    pytest.param("rot-gptq3", marks=pytest.mark.slow)])
def test_recipes_end_to_end_on_a_tiny_model(recipe, tmp_path):
    from compress.config import load_recipe
    from compress.format.checkpoint import build_quantization_config, load_quantized, save_quantized
    from compress.pipeline import quantize_model

    cfg = load_recipe(recipe).replace(nsamples=8, seqlen=32, batch_size=2, search_tokens=128, clip_tokens=64, steps=2,
                                      grid=5, clip_grid=10, calib_dtype="float32")  # the path, not the accuracy
    base = tiny_model("gemma")  # Gemma: the 1 + w norms and a tied head that the rotation unties
    model = copy.deepcopy(base)
    report = quantize_model(model, cfg, _batches())
    assert report.notes.rotate.kind == "hadamard" and report.notes.rotate.untied_head
    ids = _ids()
    ref, out = _logits(base, ids), _logits(model, ids)
    assert (out - ref).norm() / ref.norm() < 0.5
    save_quantized(model, None, tmp_path / "q", build_quantization_config(model, cfg.method, cfg.scheme))
    assert torch.equal(_logits(load_quantized(tmp_path / "q"), ids), out)


def test_rotation_lowers_the_quantization_error_of_a_model_with_outlier_channels():
    from compress.config import QuantizeConfig
    from compress.pipeline import quantize_model

    base = loud_channels(tiny_model("llama", hidden=128))
    ids = _ids(seed=3)
    ref = _logits(base, ids)
    errs = {}
    for method in ("rtn", "gptq"):
        for rot in ("none", "hadamard"):
            model = copy.deepcopy(base)
            # fallback off: both arms fit GPTQ on all 8 windows, so the comparison is the rotation's alone
            quantize_model(model, QuantizeConfig(method=method, bits=3, group_size=32, rotate=rot, fallback=False),
                           _batches(n=8))
            errs[method, rot] = (_logits(model, ids) - ref).pow(2).mean().item()
    assert errs["rtn", "hadamard"] < 0.8 * errs["rtn", "none"]
    assert errs["gptq", "hadamard"] < 0.8 * errs["gptq", "none"]
