from tiny_models import tiny_model

from compress.config import QuantizeConfig
from compress.memory import BASE_BYTES, plan


def _plan(**fields):
    return plan(tiny_model("llama"), QuantizeConfig.from_flat(**fields), streamed=False)


def test_qat_from_rtn_holds_no_calibration_activations():
    p = _plan(method="qat", init="rtn", nsamples=64, seqlen=64)
    assert p.activations == 0 and p.statistics == 0
    assert p.peak == BASE_BYTES + p.weights + p.teacher + p.training


def test_qat_from_gptq_peaks_at_the_larger_phase_not_their_sum():
    fields = dict(method="qat", init="gptq", act_order=True, static_groups=True, guided=True, sequential=False,
                  nsamples=64, seqlen=64)
    p = _plan(**fields)
    trained = _plan(method="qat", init="rtn", nsamples=64, seqlen=64)
    ptq = p.activations + p.statistics + p.gradients
    assert p.statistics > 0 and p.gradients > 0 and p.training == trained.training
    assert p.peak == BASE_BYTES + p.weights + p.teacher + max(ptq, p.training)
    assert p.peak < BASE_BYTES + p.weights + p.teacher + ptq + p.training


def test_training_graph_grows_with_the_batch_and_the_autocast_width():
    small = _plan(method="qat", batch_size=2, train_dtype="bfloat16")
    assert _plan(method="qat", batch_size=4, train_dtype="bfloat16").training > small.training
    assert _plan(method="qat", batch_size=2, train_dtype="float32").training > small.training
