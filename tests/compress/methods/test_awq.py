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


def test_clip_search_never_hurts_the_group_error():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(512, 96, generator=g)
    w = torch.randn(32, 96, generator=g) * 0.05
    w[0, 5] = 1.0  # one outlier weight stretches its group's range
    scheme = Scheme(3, 32, False)
    bounds = awq.search_clip(x, w, scheme, grid=20)
    assert bounds.lo.shape == bounds.hi.shape == (32, 3)
    assert (bounds.lo <= 0).all() and (bounds.hi >= 0).all()
    clipped = quant.quantize_weight(awq.clip_weight(w, bounds, scheme), scheme).dequantize()
    plain = quant.quantize_weight(w, scheme).dequantize()
    assert (x @ (clipped - w).T).pow(2).mean() <= (x @ (plain - w).T).pow(2).mean()


def test_clip_search_picks_each_groups_best_shrink_by_its_error_on_the_samples():
    """The search scores candidates through each group's Gram matrix; the choice is the brute-force one: per
    (row, group), the shrink factor whose clipped group has the least error over the sample rows."""
    from compress.format.quant import fake_quantize_groups

    g = torch.Generator().manual_seed(2)
    x = torch.randn(256, 64, generator=g) * torch.linspace(0.2, 3.0, 64)
    w = torch.randn(8, 64, generator=g) * 0.05
    w[:, 3] = 0.6
    scheme = Scheme(4, 32, False)
    bounds = awq.search_clip(x, w, scheme, grid=10)
    wg, xg = w.reshape(8, 2, 32), x.reshape(256, 2, 32)
    lo0, hi0 = wg.amin(-1).clamp(max=0), wg.amax(-1).clamp(min=0)
    errs = []
    for k in range(6):  # shrink factors 1, 0.9, ..., 0.5
        f = 1 - k / 10
        dq = fake_quantize_groups(torch.maximum(torch.minimum(wg, hi0[..., None] * f), lo0[..., None] * f), scheme) - wg
        errs.append(torch.einsum("ngi,ogi->nog", xg, dq).pow(2).mean(0))  # [out, G]
    best = torch.stack(errs).argmin(0)
    assert torch.allclose(bounds.hi, hi0 * (1 - best / 10)) and torch.allclose(bounds.lo, lo0 * (1 - best / 10))
