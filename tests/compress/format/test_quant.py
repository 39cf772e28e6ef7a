import functools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from compress.format.quant import (BITS, Scheme, compute_qparams, dequantize, find_params, group_index, mse_params,
                                   pack, per_word, quantize, unpack)


@settings(max_examples=60, deadline=None)
@given(bits=st.sampled_from(BITS), rows=st.integers(1, 5), n=st.integers(1, 70), seed=st.integers(0, 2**16))
def test_pack_unpack_is_a_bijection(bits, rows, n, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 2**bits, (rows, n), generator=g, dtype=torch.uint8)
    packed = pack(q, bits)
    assert packed.dtype == torch.int32 and packed.shape == (rows, math.ceil(n / per_word(bits)))
    assert torch.equal(unpack(packed, bits, n), q)


@pytest.mark.parametrize("bits", BITS)
def test_bit_order_is_lsb_first_along_in(bits):
    k = per_word(bits)
    q = torch.zeros(1, k, dtype=torch.uint8)
    q[0, 1] = 1  # the second code of the word sits at bit `bits`
    assert pack(q, bits).item() == 1 << bits
    q = torch.full((1, k), 2**bits - 1, dtype=torch.uint8)
    assert pack(q, bits).item() == (((1 << (k * bits)) - 1) if k * bits < 32 else -1)


@settings(max_examples=40, deadline=None)
@given(bits=st.sampled_from(BITS), group=st.sampled_from([-1, 8, 16, 24, 64]), sym=st.booleans(),
       n=st.integers(1, 100), seed=st.integers(0, 2**16))
def test_round_trip_error_is_at_most_half_a_step(bits, group, sym, n, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(6, n, generator=g) * 0.05
    scheme = Scheme(bits=bits, group_size=group, sym=sym)
    scale, zero = compute_qparams(w, scheme)
    assert scale.shape == (6, scheme.n_groups(n)) and scale.dtype == torch.float16
    q = quantize(w, scale, zero, scheme)
    assert q.max() <= scheme.maxq
    step = scale.float().index_select(1, group_index(n, scheme))
    err = (dequantize(q, scale, zero, scheme) - w).abs()
    assert (err <= step / 2 * (1 + 1e-5) + 1e-9).all()


def test_ragged_last_group_has_its_own_scale():
    w = torch.ones(2, 40)
    w[:, 32:] = 100.0  # the 8 ragged columns alone are large
    scheme = Scheme(bits=4, group_size=32, sym=True)
    scale, _ = compute_qparams(w, scheme)
    assert scale.shape == (2, 2)
    assert scale[0, 1] > 10 * scale[0, 0]
    assert torch.allclose(dequantize(quantize(w, scale, None, scheme), scale, None, scheme), w, rtol=1e-2)


def test_nf4_hits_codebook_exactly():
    from compress.format.quant import NF4_CODEBOOK

    scheme = Scheme(bits=4, group_size=16, sym=True, format="nf4")
    w = torch.tensor([NF4_CODEBOOK]) * 0.5
    scale, _ = compute_qparams(w, scheme)
    q = quantize(w, scale, None, scheme)
    assert q.tolist()[0] == list(range(16))
    assert torch.allclose(dequantize(q, scale, None, scheme), w, atol=1e-4)


@pytest.mark.parametrize("kw,msg", [(dict(bits=5), "bits=5"), (dict(group_size=4), "group_size=4"),
                                    (dict(format="fp4"), "format"), (dict(bits=3, format="nf4"), "nf4"),
                                    (dict(sym=True, zero_floor=1), "zero_floor=1"), (dict(zero_floor=2), "zero_floor")])
def test_bad_schemes_name_the_value(kw, msg):
    with pytest.raises(ValueError, match=msg):
        Scheme(**kw)


@pytest.mark.parametrize("scheme", [Scheme(4, 64, False), Scheme(4, 64, True), Scheme(3, 40, False),
                                    Scheme(8, -1, True), Scheme(4, 64, True, "nf4"), Scheme(4, 32, zero_floor=1)])
def test_fake_quantize_is_exactly_the_stored_round_trip(scheme):
    from compress.format.quant import fake_quantize

    w = torch.randn(48, 150, generator=torch.Generator().manual_seed(0)) * 0.02
    scale, zero = compute_qparams(w, scheme)
    assert torch.equal(fake_quantize(w, scheme), dequantize(quantize(w, scale, zero, scheme), scale, zero, scheme))


def _grid_error(w, scheme, c, params):
    """Each row's ``sum_j c_j |w_j - dq(w_j)|^2.4`` under the qparams ``params``."""
    s, z = params
    zf = float(scheme.sym_zero) if z is None else z.float()[:, None]
    q = torch.clamp(torch.round(w / s.float()[:, None]) + zf, 0, scheme.maxq)
    return (((q - zf) * s.float()[:, None] - w).abs() ** 2.4) @ c


@pytest.mark.parametrize("scheme", [Scheme(4, 64, False), Scheme(4, 64, True), Scheme(3, 64, False)])
def test_mse_params_never_worse_than_full_range(scheme):
    """The full range is one of the candidates, so the weighted error can only go down; heavy-tailed
    rows (a few outliers) should make clipping pay off on most of them."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(256, 64, generator=g) ** 3
    c = torch.rand(64, generator=g) + 0.1
    err = functools.partial(_grid_error, w, scheme, c)
    full, best = err(find_params(w, scheme)), err(mse_params(w, scheme, c))
    assert (best <= full * (1 + 1e-6)).all()
    assert (best < full).float().mean() > 0.5


def _mse_reference(w, scheme, c, grid=100, max_shrink=0.8, norm=2.4):
    """mse_params by its definition: every shrunk copy ``w * p`` through find_params, quantize and dequantize."""
    from dataclasses import replace

    row = replace(scheme, group_size=-1)
    best = None
    for k in range(int(grid * max_shrink) + 1):
        s, z = find_params(w * (1 - k / grid), scheme)
        s1, z1 = s[:, None], None if z is None else z[:, None]
        err = ((dequantize(quantize(w, s1, z1, row), s1, z1, row) - w).abs() ** norm * c).sum(1)
        if best is None:
            best = [err, s, z]
            continue
        better = err < best[0]
        best = [torch.where(better, err, best[0]), torch.where(better, s, best[1]),
                None if z is None else torch.where(better, z, best[2])]
    return best[1], best[2]


@pytest.mark.parametrize("scheme", [Scheme(4, 64, False), Scheme(4, 64, True), Scheme(3, 64, False),
                                    Scheme(4, 64, False, zero_floor=1)])
@pytest.mark.parametrize("per_row", [False, True])
def test_mse_params_is_its_definition_bit_for_bit(scheme, per_row):
    """The search takes each candidate's qparams from the rows' two ends and rounds in place; the same codes' scales
    and zeros as shrinking a copy of the weights for every candidate."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(300, 64, generator=g) ** 3 * 0.01
    w[0] = w[0].abs()  # a row above zero (its zero floors), one below, one constant
    w[1] = -w[1].abs()
    w[2] = 0.003
    c = torch.rand(300, 64, generator=g) if per_row else torch.rand(64, generator=g) + 0.1
    got, want = mse_params(w, scheme, c), _mse_reference(w, scheme, c)
    assert torch.equal(got[0], want[0])
    assert (got[1] is None and want[1] is None) or torch.equal(got[1], want[1])


def _brute_force_range(w: torch.Tensor, e: torch.Tensor, scheme: Scheme, grid: int, max_shrink: float):
    """Reference for weighted_range_params: every (row, group) and every (lo, hi) shrink pair in plain loops."""
    from compress.format.quant import fp16_ceil

    g = scheme.group(w.shape[1])
    steps = [1 - k / grid for k in range(int(grid * max_shrink) + 1)]
    pairs = [(a, a) for a in steps] if scheme.sym else [(a, b) for a in steps for b in steps]
    scales, zeros = torch.empty(w.shape[0], scheme.n_groups(w.shape[1])), torch.empty(w.shape[0], scheme.n_groups(w.shape[1]))
    for r in range(w.shape[0]):
        for j in range(scheme.n_groups(w.shape[1])):
            x, c = w[r, j * g:(j + 1) * g].double(), e[j * g:(j + 1) * g].double()
            best = None
            for a, b in pairs:
                lo, hi = min(x.min().item(), 0.0) * a, max(x.max().item(), 0.0) * b
                if scheme.sym:
                    s = fp16_ceil(torch.tensor(max(-lo, hi) / (scheme.sym_zero - 1)).clamp(min=1e-6)).item()
                    z = float(scheme.sym_zero)
                else:
                    s = fp16_ceil(torch.tensor((hi - lo) / scheme.maxq).clamp(min=1e-6)).item()
                    z = min(max(round(-lo / s), 0), scheme.maxq)
                dq = (torch.clamp(torch.round(x / s) + z, 0, scheme.maxq) - z) * s
                err = (c * (x - dq) ** 2).sum().item()
                if best is None or err < best[0] * (1 - 1e-9):
                    best = (err, s, z)
            scales[r, j], zeros[r, j] = best[1], best[2]
    return scales, zeros


@pytest.mark.parametrize("scheme", [Scheme(2, 8, False), Scheme(3, 8, True), Scheme(4, 12, False)])
def test_weighted_range_search_matches_a_brute_force_reference(scheme):
    from compress.format.quant import weighted_range_params

    g = torch.Generator().manual_seed(1)
    w = torch.randn(5, 20, generator=g) ** 3  # 20 columns: a ragged last group at group sizes 8 and 12
    e = torch.rand(20, generator=g) * torch.tensor([10.0, 0.1] * 10)  # uneven channel energies
    scale, zero = weighted_range_params(w, scheme, e, grid=10, max_shrink=0.5)
    ref_scale, ref_zero = _brute_force_range(w, e, scheme, 10, 0.5)
    torch.testing.assert_close(scale.float(), ref_scale, rtol=0, atol=0)
    if not scheme.sym:
        assert torch.equal(zero.float(), ref_zero)


@pytest.mark.parametrize("scheme", [Scheme(4, 32, False), Scheme(3, 32, True)])
def test_weighted_range_beats_min_max_on_the_weighted_output_error(scheme):
    from compress.format.quant import quantize_weight

    g = torch.Generator().manual_seed(2)
    w = torch.randn(64, 128, generator=g) ** 3
    x = torch.randn(512, 128, generator=g) * (torch.rand(128, generator=g) * 4)  # activations with loud channels
    e = x.pow(2).mean(0)
    plain, weighted = quantize_weight(w, scheme), quantize_weight(w, scheme, e)
    out_err = [(x @ (q.dequantize() - w).T).pow(2).mean().item() for q in (plain, weighted)]
    assert out_err[1] < 0.9 * out_err[0]
    # the data-free path is unchanged by the new parameter
    assert torch.equal(quantize_weight(w, scheme).q, quantize_weight(w, scheme, None).q)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_zero_floor_keeps_zeros_at_least_one_and_every_weight_within_half_a_step(bits):
    """Groups of non-negative weights (zero 0 by min/max) take zero 1; the grid still covers every weight, and
    only those groups change."""
    from compress.format.quant import weighted_range_params

    g = torch.Generator().manual_seed(0)
    w = torch.randn(16, 96, generator=g) * 0.05
    w[:8, :32] = w[:8, :32].abs()  # eight rows whose first group is non-negative
    plain, floored = Scheme(bits, 32), Scheme(bits, 32, zero_floor=1)
    s0, z0 = compute_qparams(w, plain)
    s1, z1 = compute_qparams(w, floored)
    assert int((z0 == 0).sum()) >= 8 and int(z1.min()) >= 1
    assert torch.equal(s0[z0 > 0], s1[z0 > 0]) and torch.equal(z0[z0 > 0], z1[z0 > 0])
    err = (dequantize(quantize(w, s1, z1, floored), s1, z1, floored) - w).abs()
    assert bool((err <= s1.float().repeat_interleave(32, 1) / 2 * (1 + 1e-5)).all())
    _, zw = weighted_range_params(w, floored, torch.rand(96, generator=g))
    assert int(zw.min()) >= 1
    assert floored.to_dict()["zero_floor"] == 1 and "zero_floor" not in plain.to_dict()


@pytest.mark.parametrize("scheme", [Scheme(4, 64, False), Scheme(4, 64, True), Scheme(3, 64, False)])
def test_mse_params_coarse_then_refined_is_close_to_every_step(scheme):
    """``coarse``: every 4th step, then each row's neighbours: the same step on most rows, the summed error within
    a fraction of a percent, never worse than the full range; ``coarse=1`` is the full grid."""
    g = torch.Generator().manual_seed(2)
    w = torch.randn(2000, 64, generator=g) ** 3 * 0.01
    c = torch.rand(64, generator=g) + 0.1
    err = functools.partial(_grid_error, w, scheme, c)
    every, coarse = mse_params(w, scheme, c), mse_params(w, scheme, c, coarse=4)
    assert all(torch.equal(a, b) for a, b in zip(mse_params(w, scheme, c, coarse=1), every) if a is not None)
    assert (err(coarse) <= err(find_params(w, scheme)) * (1 + 1e-6)).all()
    assert (coarse[0] == every[0]).float().mean() > 0.9
    assert err(every).sum() <= err(coarse).sum() <= err(every).sum() * 1.005
