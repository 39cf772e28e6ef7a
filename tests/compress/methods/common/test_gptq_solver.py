import pytest
import torch

from compress.config import GPTQOptions
from compress.format import quant
from compress.format.quant import Scheme
from compress.methods.common import gptq_solver


def _layer(seed=0, n=2048, d_in=96, d_out=48):
    """Correlated inputs with a few loud channels, as real activations have."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(d_in, d_in, generator=g) / d_in**0.5
    x = torch.randn(n, d_in, generator=g) @ mix * (1 + 4 * (torch.rand(d_in, generator=g) > 0.9))
    w = torch.randn(d_out, d_in, generator=g) * 0.05
    h = gptq_solver.Hessian.zeros(d_in)
    for chunk in x.split(256):
        h.add(chunk)
    return x, w, h


def test_hessian_is_running_mean_of_2xtx():
    x, _, h = _layer()
    assert h.n == x.shape[0]
    assert torch.allclose(h.H, 2 * x.T @ x / x.shape[0], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("scheme", [Scheme(4, 32, False), Scheme(4, 32, True), Scheme(3, 40, False),
                                    Scheme(2, -1, False), Scheme(8, -1, True)])
@pytest.mark.parametrize("act_order,static,mse", [(False, False, False), (True, False, False), (True, True, False),
                                                  (True, True, True), (False, False, True)])
def test_gptq_output_error_no_worse_than_rtn(scheme, act_order, static, mse):
    x, w, h = _layer()
    opts = GPTQOptions(block_size=32, act_order=act_order, static_groups=static, mse=mse)
    res = gptq_solver.quantize_weight(w, h.H, scheme, opts)
    err_gptq = (x @ (res.weight.dequantize() - w).T).pow(2).mean()
    err_rtn = (x @ (quant.quantize_weight(w, scheme).dequantize() - w).T).pow(2).mean()
    assert err_gptq <= err_rtn
    assert res.loss >= 0
    qw = res.weight
    assert qw.q.shape == w.shape and int(qw.q.max()) <= scheme.maxq
    assert (qw.g_idx is not None) == (act_order and not static)
    if qw.g_idx is not None:  # every group holds group_size columns (the last may be ragged)
        counts = torch.bincount(qw.g_idx.long())
        assert counts[:-1].eq(scheme.group(w.shape[1])).all()


def test_dead_inputs_are_zeroed():
    x, w, h = _layer()
    h.H[3, :] = 0
    h.H[:, 3] = 0
    res = gptq_solver.quantize_weight(w, h.H, Scheme(4, 32, False))
    assert torch.isfinite(res.weight.dequantize()).all()


def test_nf4_is_refused():
    _, w, h = _layer()
    with pytest.raises(ValueError, match="nf4"):
        gptq_solver.quantize_weight(w, h.H, Scheme(4, 32, True, "nf4"))


@pytest.mark.parametrize("scheme", [Scheme(4, 32, False), Scheme(3, 40, True)])
def test_weighted_range_picks_each_static_group_by_the_hessian_diagonal(scheme):
    from compress.format.quant import weighted_range_params

    x, w, h = _layer(seed=2)
    res = gptq_solver.quantize_weight(w, h.H, scheme, GPTQOptions(static_groups=True), weighted_range=True)
    # static groups take their qparams from the original weights: exactly the weighted search on each group
    want, _ = weighted_range_params(w, scheme, h.H.diagonal())
    assert torch.equal(res.weight.scale, want)
    err = {k: (x @ (q.dequantize() - w).T).pow(2).mean().item()
           for k, q in (("gptq", res.weight), ("rtn", quant.quantize_weight(w, scheme)))}
    assert err["gptq"] < err["rtn"]


def test_quantize_weight_leaves_h_unwritten():
    _, w, h = _layer()
    H = h.H.clone()
    gptq_solver.quantize_weight(w, h.H, Scheme(4, 32, False), GPTQOptions(act_order=True, static_groups=True, mse=True))
    assert torch.equal(h.H, H)


def test_released_hessian_peaks_at_two_matrices():
    """At width 14336 (an 8B model's down_proj) each [in, in] matrix is 0.77 GiB: once the caller hands its
    Hessian over, GPTQ holds at most two of them (working copy and next factor), not the four it once did."""
    from compress.job import peak_rss
    from peak import reset_peak

    d_in = 3072  # 36 MiB a matrix: far above the allocator's noise, a second of Cholesky
    x = torch.randn(d_in + 512, d_in)
    opts = GPTQOptions(act_order=True, static_groups=True, mse=True)
    h = gptq_solver.Hessian.zeros(d_in)
    h.add(x)
    del x
    w = torch.randn(8, d_in)
    gptq_solver.quantize_weight(w, h.H.clone(), Scheme(4, 64, False), opts)  # warm up the kernels' own buffers
    if (before := reset_peak()) is None:
        pytest.skip("needs /proc/self/clear_refs to measure the peak")
    gptq_solver.quantize_weight(w, h.release(), Scheme(4, 64, False), opts)
    matrices = (peak_rss() - before) / (d_in * d_in * 4)
    assert h.H is None
    assert matrices < 1.5, matrices  # the released H was already resident: one more matrix at a time


@pytest.mark.parametrize("d_in,g,sym,mse,weighted_range", [(40, 64, False, True, False), (200, 64, False, True, False), (256, 64, True, True, False),
                                                          (200, 64, False, False, False), (200, 64, False, False, True),
                                                          (130, 32, True, False, True)])
def test_static_params_equal_the_group_by_group_search(d_in, g, sym, mse, weighted_range):
    """Static groups' qparams come from a few stacked calls; they must be exactly what each group alone gets."""
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(48, d_in, generator=gen)
    w[:, 3] *= 20
    hdiag = torch.rand(d_in, generator=gen) + 0.1
    scheme = Scheme(4, g, sym)
    one = gptq_solver._group_params(scheme, g, mse, weighted_range)
    want = [one(w[:, j * g:(j + 1) * g], hdiag[j * g:(j + 1) * g]) for j in range(scheme.n_groups(d_in))]
    got = gptq_solver._static_params(w, hdiag, scheme, g, mse, weighted_range, chunk=5 * g)  # several chunks
    assert len(got) == len(want)
    for (s, z), (s0, z0) in zip(got, want):
        assert torch.equal(s, s0)
        assert (z is None and z0 is None) or torch.equal(z, z0)


@pytest.mark.parametrize("scheme", [Scheme(4, 32, False), Scheme(3, 40, True)])
@pytest.mark.parametrize("act_order,static", [(False, False), (True, True), (True, False)])
def test_kept_latent_rounds_to_the_codes(scheme, act_order, static):
    """keep_latent records each weight as GPTQ rounded it: its code is round(latent / s) + z (clamped), in natural
    column order whatever the processing order, and it differs from the input (the error feedback moved it)."""
    x, w, h = _layer()
    opts = GPTQOptions(block_size=32, act_order=act_order, static_groups=static)
    res = gptq_solver.quantize_weight(w, h.H, scheme, opts, keep_latent=True)
    qw = res.weight
    g_idx = qw.g_idx.long() if qw.g_idx is not None else torch.arange(w.shape[1]) // scheme.group(w.shape[1])
    s = qw.scale.float()[:, g_idx]
    z = qw.zero.float()[:, g_idx] if qw.zero is not None else scheme.sym_zero
    codes = torch.clamp(torch.round(res.latent / s) + z, 0, scheme.maxq)
    assert torch.equal(codes, qw.q.float())
    assert not torch.allclose(res.latent, w, atol=1e-4)
    assert gptq_solver.quantize_weight(w, h.H, scheme, opts).latent is None
    assert torch.equal(gptq_solver.quantize_weight(w, h.H, scheme, opts).weight.q, qw.q)  # keeping it changes nothing


def test_damp_of_median_is_the_mean_damp_scaled_by_the_diagonals_ratio():
    """``damp_of: median`` damps by a fraction of the diagonal's median: the same solve as that fraction of the mean
    times median / mean, on a layer whose one input channel is 300x louder on 2% of tokens (massive activations)."""
    x, w, _ = _layer()
    x[torch.rand(x.shape[0], generator=torch.Generator().manual_seed(1)) < 0.02, 0] *= 300
    h = gptq_solver.Hessian.zeros(x.shape[1])
    h.add(x)
    d = h.H.diagonal()
    assert d.mean() / d.median() > 20  # the outlier sets the mean: a mean-relative damp swamps the other channels
    scheme = Scheme(4, 32, False)
    by_median = gptq_solver.quantize_weight(w, h.H, scheme, GPTQOptions(damp=0.1, damp_of="median", act_order=True))
    by_mean = gptq_solver.quantize_weight(w, h.H, scheme, GPTQOptions(damp=0.1 * float(d.median() / d.mean()),
                                                                     act_order=True))
    assert torch.equal(by_median.weight.q, by_mean.weight.q)
    err = {k: (x @ (r.weight.dequantize() - w).T).pow(2).mean() for k, r in
           [("median", by_median), ("mean", gptq_solver.quantize_weight(w, h.H, scheme, GPTQOptions(damp=0.1,
                                                                                               act_order=True)))]}
    assert err["median"] < err["mean"]
    with pytest.raises(ValueError, match="damp_of='max'"):
        GPTQOptions(damp_of="max")
