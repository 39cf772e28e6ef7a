import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from compress.quant import (BITS, Scheme, compute_qparams, dequantize, find_params, group_index, mse_params, pack,
                            per_word, quantize, unpack)


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
    from compress.quant import NF4_CODEBOOK

    scheme = Scheme(bits=4, group_size=16, sym=True, format="nf4")
    w = torch.tensor([NF4_CODEBOOK]) * 0.5
    scale, _ = compute_qparams(w, scheme)
    q = quantize(w, scale, None, scheme)
    assert q.tolist()[0] == list(range(16))
    assert torch.allclose(dequantize(q, scale, None, scheme), w, atol=1e-4)


@pytest.mark.parametrize("kw,msg", [(dict(bits=5), "bits=5"), (dict(group_size=4), "group_size=4"),
                                    (dict(format="fp4"), "format"), (dict(bits=3, format="nf4"), "nf4")])
def test_bad_schemes_name_the_value(kw, msg):
    with pytest.raises(ValueError, match=msg):
        Scheme(**kw)


@pytest.mark.parametrize("scheme", [Scheme(4, 64, False), Scheme(4, 64, True), Scheme(3, 40, False),
                                    Scheme(8, -1, True), Scheme(4, 64, True, "nf4")])
def test_fake_quantize_is_exactly_the_stored_round_trip(scheme):
    from compress.quant import fake_quantize

    w = torch.randn(48, 150, generator=torch.Generator().manual_seed(0)) * 0.02
    scale, zero = compute_qparams(w, scheme)
    assert torch.equal(fake_quantize(w, scheme), dequantize(quantize(w, scale, zero, scheme), scale, zero, scheme))


@pytest.mark.parametrize("scheme", [Scheme(4, 64, False), Scheme(4, 64, True), Scheme(3, 64, False)])
def test_mse_params_never_worse_than_full_range(scheme):
    """The full range is one of the candidates, so the weighted error can only go down; heavy-tailed
    rows (a few outliers) should make clipping pay off on most of them."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(256, 64, generator=g) ** 3
    c = torch.rand(64, generator=g) + 0.1

    def err(params):
        s, z = params
        zf = float(scheme.sym_zero) if z is None else z.float()[:, None]
        q = torch.clamp(torch.round(w / s.float()[:, None]) + zf, 0, scheme.maxq)
        return (((q - zf) * s.float()[:, None] - w).abs() ** 2.4) @ c

    full, best = err(find_params(w, scheme)), err(mse_params(w, scheme, c))
    assert (best <= full * (1 + 1e-6)).all()
    assert (best < full).float().mean() > 0.5
