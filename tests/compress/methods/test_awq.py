import pytest
import torch

from compress.format import quant
from compress.format.quant import Scheme
from compress.methods import awq


def test_awq_beats_rtn_on_outlier_input_channels():
    g = torch.Generator().manual_seed(0)
    d_in, d_out = 128, 64
    x = torch.randn(2048, d_in, generator=g)
    x[:, :4] *= 30  # a few outlier input channels, as in real LLM activations
    w = torch.randn(d_out, d_in, generator=g) * 0.05
    scheme = Scheme(4, 64, False)
    ref = x @ w.T
    res = awq.search_scale(x.abs().mean(0), [w], scheme, awq.linear_error(x, [w]), grid=20)
    assert res.ratio > 0 and res.loss < res.base_loss
    # the scales fold away exactly: (w * s) quantized, inputs divided by s
    wq = quant.quantize_weight(w * res.scales, scheme).dequantize()
    err_awq = ((x / res.scales) @ wq.T - ref).pow(2).mean()
    err_rtn = (x @ quant.quantize_weight(w, scheme).dequantize().T - ref).pow(2).mean()
    assert err_awq < 0.8 * err_rtn


@pytest.mark.parametrize("rows", [48, 300])  # fewer rows than inputs: on x itself; more: through the Gram matrix
def test_linear_error_is_the_mse_of_the_concatenated_outputs(rows):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(rows, 96, generator=g)
    ws = [torch.randn(16, 96, generator=g), torch.randn(8, 96, generator=g)]
    cand = [w + 0.01 * torch.randn(w.shape, generator=g) for w in ws]
    want = torch.nn.functional.mse_loss(torch.cat([x @ w.T for w in cand], -1), torch.cat([x @ w.T for w in ws], -1))
    assert awq.linear_error(x, ws)(cand) == pytest.approx(want.item(), rel=1e-4)


def test_linear_error_in_bfloat16_is_the_same_number_to_bf16_precision():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(64, 96, generator=g), torch.randn(32, 96, generator=g)  # wider than its rows: the direct form
    cand = [quant.fake_quantize(w, Scheme(4, 32, False))]
    exact, low = awq.linear_error(x, [w])(cand), awq.linear_error(x, [w], torch.bfloat16)(cand)
    assert low != exact and abs(low - exact) / exact < 2e-2


def test_windows_awq_never_reads_skip_the_blocks_with_the_same_result(monkeypatch):
    """With RTN rounding and observe_tokens, a dense model's blocks carry only the first fitting windows and the
    held-out ones: bit for bit what carrying every window writes, with fewer windows through each block."""
    import copy

    from tiny_models import tiny_model

    from compress import calibrate
    from compress.config import QuantizeConfig
    from compress.pipeline import quantize_model

    g = torch.Generator().manual_seed(5)
    batches = list(torch.randint(0, 256, (16, 32), generator=g).split(2))  # 8 batches of 2 x 32 tokens
    cfg = QuantizeConfig.from_flat(method="awq", bits=4, group_size=32, search_tokens=64, observe_tokens=128,
                                   fallback=True, holdout=0.25)
    base = tiny_model("llama")
    carried = []
    real = calibrate.run_sequential

    def spy(model, batches, *args, **kwargs):
        carried.append(len(batches))
        return real(model, batches, *args, **kwargs)

    monkeypatch.setattr(awq, "run_sequential", spy)
    trimmed = copy.deepcopy(base)
    quantize_model(trimmed, cfg, batches)
    monkeypatch.setattr(awq, "_carried_batches", lambda run, cfg: run.batches)
    full = copy.deepcopy(base)
    quantize_model(full, cfg, batches)
    assert carried == [4, 8]  # 2 fitting batches hold the 128 observed tokens, plus the 2 held out
    a, b = trimmed.state_dict(), full.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
