import copy

import pytest
import torch
from tiny_models import FAMILIES, MOE_FAMILIES, tiny_model

from compress.calibrate import decoder_layers
from compress.mappings import block_map
from compress.rotate import residual_map, rotate_model


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def _ids(vocab=256, seed=1):
    return torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(seed))


def _assert_same_function(base, rotated, vocab=256):
    ids = _ids(vocab)
    ref, out = _logits(base, ids), _logits(rotated, ids)
    assert (out - ref).abs().max() <= 1e-5 * ref.abs().max()  # fp32 rounding of a different summation order


@pytest.mark.parametrize("family", FAMILIES + MOE_FAMILIES)
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


def test_a_family_that_cannot_be_folded_is_refused_by_name_before_any_change():
    import transformers as tf

    cfg = tf.Gemma2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=16, vocab_size=64)
    model = tf.AutoModelForCausalLM.from_config(cfg).eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="'gemma2' cannot be rotated: its post-attention and post-feedforward norms"):
        rotate_model(model, "hadamard")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_a_model_that_does_not_match_its_map_is_refused():
    model = tiny_model("llama")
    del decoder_layers(model)[0].mlp.up_proj
    with pytest.raises(ValueError, match=r"expected weights \['mlp.up_proj.weight'\] are missing"):
        residual_map(model)
