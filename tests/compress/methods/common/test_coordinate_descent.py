import pytest
import torch

from compress.config import GPTQOptions
from compress.format.quant import Scheme
from compress.methods.common import coordinate_descent, gptq_solver
from test_gptq_solver import _layer as correlated_layer  # (this folder is on sys.path: pytest's prepend mode)


def _layer(seed=0, n=1024, d_in=64, d_out=24):
    """test_gptq_solver's correlated inputs with a few loud channels: the weight and its Hessian."""
    _, w, h = correlated_layer(seed, n, d_in, d_out)
    return w, h.H


def _damped(H, damp):
    return H + damp * H.diagonal().mean() * torch.eye(H.shape[0])


def _error(w, qw, H):
    e = w - qw.dequantize()
    return float((e @ H * e).sum())


@pytest.mark.parametrize("scheme", [Scheme(4, 16, False), Scheme(4, 16, True), Scheme(3, 24, False),
                                    Scheme(2, -1, False)])
@pytest.mark.parametrize("act_order,static", [(False, False), (True, False), (True, True)])
def test_sweeps_lower_gptqs_quadratic_error_and_keep_its_grid(scheme, act_order, static):
    """The refined codes sit on GPTQ's own scales and zeros (and act-order's g_idx), with a lower damped error; the
    loss reported is half that error, as GPTQ's own loss is half of its."""
    w, H = _layer()
    opts = GPTQOptions(damp=0.05, block_size=16, act_order=act_order, static_groups=static)
    plain = gptq_solver.quantize_weight(w, H, scheme, opts)
    refined = gptq_solver.quantize_weight(w, H, scheme, GPTQOptions(**{**opts.__dict__, "cd_passes": 3}))
    Hd = _damped(H, 0.05)
    before, after = _error(w, plain.weight, Hd), _error(w, refined.weight, Hd)
    assert after < before
    assert plain.loss == pytest.approx(before / 2, rel=1e-3)
    assert refined.loss == pytest.approx(after / 2, rel=1e-3)
    assert torch.equal(refined.weight.scale, plain.weight.scale)
    assert refined.weight.zero is None and plain.weight.zero is None or torch.equal(refined.weight.zero,
                                                                                      plain.weight.zero)
    assert refined.weight.g_idx is None and plain.weight.g_idx is None or torch.equal(refined.weight.g_idx,
                                                                                      plain.weight.g_idx)
    assert (refined.weight.q != plain.weight.q).any()


def test_converged_codes_are_a_coordinatewise_minimum():
    """Run to convergence, no single code (any row, any column, any grid point) lowers the error: the move each
    sweep makes is the exact minimiser along its coordinate."""
    w, H = _layer(seed=1, d_in=16, d_out=3)
    scheme = Scheme(3, 8, False)
    res = gptq_solver.quantize_weight(w, H, scheme, GPTQOptions(damp=0.05, cd_passes=50))
    Hd = _damped(H, 0.05)
    best = _error(w, res.weight, Hd)
    q = res.weight.q
    for r in range(q.shape[0]):
        for c in range(q.shape[1]):
            for code in range(scheme.maxq + 1):
                if code == q[r, c]:
                    continue
                q2 = q.clone()
                q2[r, c] = code
                moved = type(res.weight)(q2, res.weight.scale, res.weight.zero, scheme, res.weight.g_idx)
                assert _error(w, moved, Hd) >= best - 1e-6 * abs(best)


def test_refine_stops_when_a_sweep_moves_nothing_and_reports_both_errors():
    """A weight already on its grid at zero error: nothing moves, both errors are 0."""
    g = torch.Generator().manual_seed(0)
    H = torch.eye(8) + 0.1
    Q = torch.randint(0, 16, (4, 8), generator=g, dtype=torch.uint8)
    scales = torch.full((4, 1), 0.1, dtype=torch.float16)
    zeros = torch.full((4, 1), 8, dtype=torch.uint8)
    W = (Q.float() - 8) * scales.float()
    kept = Q.clone()
    before, after = coordinate_descent.refine(W, H, Q, scales, zeros, torch.zeros(8, dtype=torch.long),
                                              Scheme(4, 8, False), passes=10)
    assert before == pytest.approx(0, abs=1e-10) and after == pytest.approx(0, abs=1e-10)
    assert torch.equal(Q, kept)


def test_cd_passes_must_not_be_negative():
    with pytest.raises(ValueError, match="cd_passes=-1"):
        GPTQOptions(cd_passes=-1)


@pytest.mark.parametrize("sym", [False, True])
def test_native_sweeps_match_the_torch_loop_bit_for_bit(monkeypatch, sym):
    """runtime/kernels/cpu/cd.cpp runs each row's sweeps alone; the codes, the dequantized weight and E H come out
    exactly as the reference loop's (where the kernels build; skipped elsewhere)."""
    if not coordinate_descent._native():
        pytest.skip("no native CPU kernels here")
    w, H = _layer(seed=2, d_in=96, d_out=40)
    scheme = Scheme(4, 32, sym)
    res = gptq_solver.quantize_weight(w, H, scheme, GPTQOptions(damp=0.05, act_order=True, static_groups=True))
    Hd = _damped(H, 0.05)
    perm = torch.randperm(96, generator=torch.Generator().manual_seed(0))  # columns in some processing order
    args = (res.weight.scale, res.weight.zero, perm // 32, scheme, 4)
    Q_native, Q_torch = res.weight.q[:, perm].clone(), res.weight.q[:, perm].clone()
    native = coordinate_descent.refine(w[:, perm], Hd[perm][:, perm], Q_native, *args)
    monkeypatch.setattr(coordinate_descent, "_native", lambda: False)
    reference = coordinate_descent.refine(w[:, perm], Hd[perm][:, perm], Q_torch, *args)
    assert torch.equal(Q_native, Q_torch)
    assert native == reference
    assert not torch.equal(Q_torch, res.weight.q[:, perm])  # something moved
