"""The clipping-range search: it never makes a group's output error worse than the full range, and through the Gram
matrices it picks what the brute-force search over the sample rows picks."""
import torch

from compress.format import quant
from compress.format.quant import Scheme
from compress.methods.common import clip


def test_clip_search_never_hurts_the_group_error():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(512, 96, generator=g)
    w = torch.randn(32, 96, generator=g) * 0.05
    w[0, 5] = 1.0  # one outlier weight stretches its group's range
    scheme = Scheme(3, 32, False)
    bounds = clip.search_clip(x, w, scheme, grid=20)
    assert bounds.lo.shape == bounds.hi.shape == (32, 3)
    assert (bounds.lo <= 0).all() and (bounds.hi >= 0).all()
    clipped = quant.quantize_weight(clip.clip_weight(w, bounds, scheme), scheme).dequantize()
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
    bounds = clip.search_clip(x, w, scheme, grid=10)
    wg, xg = w.reshape(8, 2, 32), x.reshape(256, 2, 32)
    lo0, hi0 = wg.amin(-1).clamp(max=0), wg.amax(-1).clamp(min=0)
    errs = []
    for k in range(6):  # shrink factors 1, 0.9, ..., 0.5
        f = 1 - k / 10
        dq = fake_quantize_groups(torch.maximum(torch.minimum(wg, hi0[..., None] * f), lo0[..., None] * f), scheme) - wg
        errs.append(torch.einsum("ngi,ogi->nog", xg, dq).pow(2).mean(0))  # [out, G]
    best = torch.stack(errs).argmin(0)
    assert torch.allclose(bounds.hi, hi0 * (1 - best / 10)) and torch.allclose(bounds.lo, lo0 * (1 - best / 10))
