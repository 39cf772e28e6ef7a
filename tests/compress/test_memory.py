import pytest
import torch

from tiny_models import tiny_model

from compress.config import QuantizeConfig
from compress.memory import BASE_BYTES, plan


def _plan(**fields):
    return plan(tiny_model("llama"), QuantizeConfig.from_flat(**fields), streamed=False)


def test_qat_from_rtn_holds_no_calibration_activations():
    p = _plan(method="qat", init="rtn", nsamples=64, seqlen=64)
    assert p.activations == 0 and p.statistics == 0
    assert p.peak == BASE_BYTES + p.weights + p.teacher + p.training + p.outer


def test_qat_from_gptq_peaks_at_the_larger_phase_not_their_sum():
    fields = dict(method="qat", init="gptq", act_order=True, static_groups=True, guided=True, sequential=False,
                  nsamples=64, seqlen=64)
    p = _plan(**fields)
    trained = _plan(method="qat", init="rtn", nsamples=64, seqlen=64)
    assert p.statistics > 0 and p.gradients > 0 and p.training == trained.training
    assert p.ptq == max(p.gradients, p.activations + p.statistics)  # the gradient pass's graph goes before the blocks
    assert p.peak == BASE_BYTES + p.weights + p.teacher + max(p.ptq, p.training) + p.outer
    assert p.peak < BASE_BYTES + p.weights + p.teacher + p.ptq + p.training + p.outer


def test_coordinate_descent_counts_a_third_hessian_and_four_weight_sized_tensors():
    """methods/common/coordinate_descent.py keeps the damped Hessian of the widest input beside GPTQ's two, and its
    target, result, E H and a gathered scale or zero the size of the largest weight."""
    linears = [m for m in tiny_model("llama").model.layers[0].modules() if isinstance(m, torch.nn.Linear)]
    widest = max(m.in_features for m in linears)
    largest = max(m.in_features * m.out_features for m in linears)
    plain, cd = (_plan(method="gptq", act_order=True, static_groups=True, cd_passes=n, nsamples=8, seqlen=64)
                 for n in (0, 3))
    assert cd.statistics - plain.statistics == 4 * widest ** 2 + 4 * 4 * largest


def test_the_gradient_pass_holds_bfloat16_sources_linears_at_half_their_fp32_bytes(tmp_path):
    from compress.format.shards import ShardReader
    from compress.stream import blocks_bfloat16, skeleton

    fields = dict(method="gptq", act_order=True, static_groups=True, guided=True, nsamples=64, seqlen=64)
    model = tiny_model("llama")
    fp32, bf16 = (plan(model, QuantizeConfig.from_flat(**fields), streamed=False, bf16_blocks=b) for b in (False, True))
    linears = sum(m.weight.numel() for b in model.model.layers for m in b.modules() if isinstance(m, torch.nn.Linear))
    assert fp32.halved == 0 and bf16.halved == 2 * linears
    assert bf16.ptq == max(bf16.gradients - bf16.halved, bf16.activations + bf16.statistics) <= fp32.ptq
    assert plan(model, QuantizeConfig.from_flat(method="gptq"), streamed=False, bf16_blocks=True).halved == 0
    model.save_pretrained(tmp_path / "fp32")
    model.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    assert [blocks_bfloat16(skeleton(tmp_path / d), ShardReader(tmp_path / d)) for d in ("fp32", "bf16")] == [0, 1]


def test_training_graph_grows_with_the_batch_and_the_autocast_width():
    small = _plan(method="qat", batch_size=2, train_dtype="bfloat16")
    assert _plan(method="qat", batch_size=4, train_dtype="bfloat16").training > small.training
    assert _plan(method="qat", batch_size=2, train_dtype="float32").training > small.training


def test_the_embedding_and_head_count_with_the_vocabulary():
    small, large = (plan(tiny_model("llama", vocab=v), QuantizeConfig(embed="int8", head="int8"), streamed=True)
                    for v in (256, 32768))
    assert large.outer - small.outer >= (32768 - 256) * (64 * 2 + 1024)  # two int8 tables and the tokenizer


# a 262,144-token tied table on two thin blocks: the vocabulary, not the depth, sets the memory (a 270M model's shape)
@pytest.mark.parametrize("recipe,stream,embed", [("rtn4", True, "int8"), ("awq4", True, "none"),
                                                 ("gptq4", False, "int8"), ("guided-gptq4", False, "int8")])
def test_the_estimate_bounds_the_peak_on_a_large_vocabulary(tmp_path, smol_tokenizer, calib_text, recipe, stream,
                                                            embed):
    from compress.config import load_recipe
    from compress.job import peak_rss, quantize_to_folder
    from compress.format.shards import ShardReader
    from compress.stream import blocks_bfloat16, skeleton
    from peak import reset_peak

    def save(name, **kw):
        model = tiny_model("llama", **kw).to(torch.bfloat16)
        model.config.tie_word_embeddings = True
        model.save_pretrained(tmp_path / name)
        smol_tokenizer.save_pretrained(tmp_path / name)
        return tmp_path / name

    cfg = load_recipe(recipe).replace(calib=str(calib_text), nsamples=8, seqlen=64, batch_size=4, embed=embed)
    warm = save("warm", vocab=len(smol_tokenizer))  # first-use imports are the process's, not the run's
    quantize_to_folder(str(warm), cfg, str(tmp_path / "w"), stream=stream)
    src = save("large", hidden=128, vocab=262144)
    if (before := reset_peak()) is None:
        pytest.skip("needs /proc/self/clear_refs to measure the peak")
    quantize_to_folder(str(src), cfg, str(tmp_path / "o"), stream=stream)
    grown = peak_rss() - before
    skel = skeleton(src)
    assert blocks_bfloat16(skel, ShardReader(src))  # the gradient pass holds the linears as bfloat16: counted so
    estimate = plan(skel, cfg, stream, bf16_blocks=True).peak - BASE_BYTES  # the process is already resident here
    assert grown <= estimate, (grown / 2**20, estimate / 2**20)


def test_a_tied_table_counts_once_in_the_whole_model(tmp_path):
    """A meta skeleton does not share the tied table between embedding and head: the estimate counts it once."""
    from compress.calibrate import decoder_layers
    from compress.stream import skeleton

    model = tiny_model("llama", vocab=4096)
    model.config.tie_word_embeddings = True
    model.save_pretrained(tmp_path)
    skel = skeleton(tmp_path)
    assert skel.lm_head.weight is not skel.model.embed_tokens.weight  # what the estimate has to see through
    own = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("lm_head"))
    block = max(sum(p.numel() for p in b.parameters()) for b in decoder_layers(skel)) * 4
    assert plan(skel, QuantizeConfig(), streamed=False).weights == own * 4 + block
