"""GGUF block packers against the gguf package's own dequantizer (and its quantizer, for requantize)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from compress.exporters import gguf_quants as gq
from compress.format.quant import Scheme, compute_qparams, dequantize, quantize

gguf = pytest.importorskip("gguf")
T = gguf.GGMLQuantizationType


def _weights(rows: int, n: int, kind: str, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, n, generator=g)
    if kind == "zero-groups":
        w[:, :32] = 0
        w[1, :] = 0
    elif kind == "extreme":  # scales from 1e-4 to 1e3 within one tensor, outliers, one-signed groups
        w = w * torch.logspace(-4, 3, rows)[:, None]
        w[0, 5] = 5e4
        w[1] = w[1].abs()
        w[-1] = -w[-1].abs()
    return w


def _reference(data: torch.Tensor, qtype, n: int) -> np.ndarray:
    return gguf.quants.dequantize(data.numpy(), qtype).reshape(data.shape[0], n)


KINDS = ["normal", "zero-groups", "extreme"]
SHAPES = [(5, 32), (3, 96), (7, 160)]  # odd row counts, widths of 1, 3 and 5 blocks


def _ours(rows: int, n: int, kind: str, scheme: Scheme):
    """Our codes, scales, zeros and dequantized weights for a random tensor."""
    w = _weights(rows, n, kind)
    scale, zero = compute_qparams(w, scheme)
    codes = quantize(w, scale, zero, scheme)
    return codes, scale, zero, dequantize(codes, scale, zero, scheme)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows,n", SHAPES)
@pytest.mark.parametrize("bits", [4, 8])
def test_q4_0_and_q8_0_are_bit_identical_to_our_symmetric_codes(bits, kind, rows, n):
    codes, scale, _, ours = _ours(rows, n, kind, Scheme(bits, 32, sym=True))
    if bits == 4:
        data, qtype, width = gq.pack_q4_0(codes, scale), T.Q4_0, 18
    else:
        data, qtype, width = gq.pack_q8_0(codes.to(torch.int16) - 128, scale), T.Q8_0, 34
    assert data.dtype == torch.uint8 and data.shape == (rows, n // 32 * width)
    np.testing.assert_array_equal(_reference(data, qtype, n), ours.numpy())


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows,n", SHAPES)
def test_q4_1_matches_our_asymmetric_4bit_within_fp16_rounding_of_the_minimum(kind, rows, n):
    codes, scale, zero, ours = _ours(rows, n, kind, Scheme(4, 32, sym=False))
    m = -scale.float() * zero.float()
    data = gq.pack_q4_1(codes, scale, m)
    assert data.shape == (rows, n // 32 * 20)
    ref = torch.from_numpy(_reference(data, T.Q4_1, n))
    # the only rounding is m = -scale * zero to fp16: at most half an fp16 ulp of |m|, per group
    m_err = (m - m.half().float()).abs().repeat_interleave(32, dim=1)
    assert ((ref - ours).abs() <= m_err + 1e-6 * ours.abs()).all()


@pytest.mark.parametrize("qtype", ["q4_0", "q4_1", "q8_0"])
@pytest.mark.parametrize("kind", KINDS)
def test_requantize_follows_llama_cpp_rounding(qtype, kind):
    w = _weights(6, 128, kind).float()
    ours = gq.REQUANTIZE[qtype](w)
    ref = gguf.quants.quantize(w.numpy(), getattr(T, qtype.upper()))
    assert ours.shape == ref.shape
    np.testing.assert_array_equal(ours.numpy(), ref)


def test_packers_handle_stacked_expert_tensors():
    s = Scheme(4, 32, sym=True)
    w = _weights(4 * 6, 64, "normal")
    scale, _ = compute_qparams(w, s)
    codes = quantize(w, scale, None, s)
    flat = gq.pack_q4_0(codes, scale)
    stacked = gq.pack_q4_0(codes.reshape(4, 6, 64), scale.reshape(4, 6, 2))
    assert torch.equal(stacked.reshape(flat.shape), flat)


def test_row_length_must_be_whole_blocks():
    with pytest.raises(AssertionError, match="multiple of 32"):
        gq.requantize_q8_0(torch.zeros(2, 40))


@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("kind", KINDS)
def test_q4_k_keeps_the_codes_and_rounds_only_the_scales_to_6_bits(sym, kind):
    s = Scheme(4, 32, sym=sym)
    codes, scale, zero, ours = _ours(3, 512, kind, s)
    minus = scale.float() * (s.sym_zero if zero is None else zero.float())  # w = scale * q - minus
    data = gq.pack_q4_k(codes, scale, minus)
    assert data.shape == (3, 2 * 144)
    ref = torch.from_numpy(_reference(data, T.Q4_K, 512)).reshape(3, 2, 8, 32)
    # the header's fp16 steps, and the 6-bit multiples our rule picks: gguf must read back exactly these
    head = data.reshape(3, 2, 144)[..., :4].contiguous().view(torch.float16).float()  # [3, 2, 2]: d, dmin
    d, dmin = head[..., :1], head[..., 1:]
    sc = torch.round(scale.float().reshape(3, 2, 8) / d).clamp(0, 63)
    mn = torch.round(minus.reshape(3, 2, 8) / dmin).clamp(0, 63)
    want = (d * sc)[..., None] * codes.float().reshape(3, 2, 8, 32) - (dmin * mn)[..., None]
    torch.testing.assert_close(ref, want, rtol=1e-6, atol=1e-6 * float(want.abs().max()))
    # so the change from our weights is the 6-bit rounding of scale and minus: at most half a step each
    bound = (15 * d / 2 + dmin / 2)[..., None] * 1.0001
    assert ((ref - ours.reshape(3, 2, 8, 32)).abs() <= bound).all()


def test_q6_k_layout_matches_the_gguf_dequantizer():
    """Any 6-bit codes, int8 scales and fp16 d dequantize through gguf to exactly d * sc * (q - 32)."""
    g = torch.Generator().manual_seed(1)
    q = torch.randint(0, 64, (3, 512), generator=g, dtype=torch.uint8)
    sc = torch.randint(-128, 128, (3, 32), generator=g).to(torch.int8)
    d = (torch.rand(3, 2, generator=g) * 1e-2).half()
    want = d.float().repeat_interleave(256, 1) * sc.float().repeat_interleave(16, 1) * (q.float() - 32)
    np.testing.assert_array_equal(_reference(gq.pack_q6_k(q, sc, d), T.Q6_K, 512), want.numpy())


@pytest.mark.parametrize("kind", ["normal", "zero-groups", "extreme"])
def test_requantize_q6_k_is_within_a_step_of_each_sub_block(kind):
    """Codes run -32..31 and the signed absmax maps to -32, so a value of the opposite sign and the same magnitude
    clips by one step; the int8 scale adds up to 16 of the super-block's ``d = top / 128`` (17 with d's fp16)."""
    w = _weights(6, 512, kind)
    got = torch.from_numpy(_reference(gq.requantize_q6_k(w), T.Q6_K, 512).copy()).reshape(6, -1, 16)
    sub = w.reshape(6, -1, 16)  # [rows, 32 sub-blocks, 16]
    step = sub.abs().amax(-1, keepdim=True) / 32
    top = step.reshape(6, 2, 16).amax(-1).repeat_interleave(16, dim=1)[..., None]  # each super-block's largest step
    assert bool(((got - sub).abs() <= step + 17 * top / 128).all())
