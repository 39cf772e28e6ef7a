"""The W8A8 VNNI kernel (runtime/kernels/cpu/qgemv.cpp) against its torch reference and QuantLinear."""
import math

import pytest
import torch

from compress.format.quant import Scheme
from runtime.kernels import cpu_ext, w8a8
from runtime.kernels.qmatmul import prepare_linear
from test_qmatmul import random_qlinear


@pytest.fixture(scope="module", autouse=True)
def kernels():
    if not cpu_ext.load() or not w8a8.available():
        pytest.skip("no AVX512-VNNI kernels on this CPU (the int4pack/int8pack paths run instead)")


def test_pack_tiles_layout():
    codes = torch.randint(0, 16, (20, 64), dtype=torch.uint8)
    t = w8a8.pack_tiles(codes, 4)
    assert t.shape == (2, 64 * 16 // 2)
    # tile 1, column group p=3, row 2 (global row 18), byte i=1: q[18, 25] | q[18, 29] << 4
    b = t[1].reshape(8, 16, 4)[3, 2, 1]
    assert b == codes[18, 25] | (codes[18, 29] << 4)
    assert (t[1].reshape(8, 16, 4)[:, 4:] == 0).all()  # rows 20..31 are padding
    t8 = w8a8.pack_tiles(codes.clamp(max=255), 8)
    assert t8.shape == (2, 64 * 16)
    assert t8[1].reshape(8, 2, 16, 4)[3, 1, 2, 1] == codes[18, 29]


def test_tile_rows():
    v = torch.arange(20 * 3, dtype=torch.float32).reshape(20, 3)
    t = w8a8.tile_rows(v)
    assert t.shape == (2, 3, 16) and t[1, 2, 3] == v[19, 2] and (t[1, :, 4:] == 0).all()
    assert torch.equal(w8a8.untile_rows(t, 20), v)


@pytest.mark.parametrize("magnitude", [1e-2, 1e-7, 3e4])
def test_half_scales_keep_fp16_precision_at_any_magnitude(magnitude):
    g = torch.Generator().manual_seed(0)
    scale = torch.rand(3, 4, 16, generator=g) * magnitude
    scale[0, 0, :4] = 0  # all-zero groups stay zero
    szero = scale * torch.randint(0, 16, scale.shape, generator=g)
    h = w8a8.half_scales(scale, szero)
    assert h.scale.dtype == h.szero.dtype == torch.float16 and h.scale.shape == scale.shape
    assert math.frexp(h.unscale)[0] == 0.5  # a power of two: undoing it is exact
    for half, want in ((h.scale, scale), (h.szero, szero)):
        got = half.float() * h.unscale
        assert ((got - want).abs() <= 2 ** -11 * want.abs()).all()  # fp16's rounding, never subnormal
        assert (got == 0).eq(want == 0).all()
    assert w8a8.half_scales(torch.zeros(1, 1, 16), torch.zeros(1, 1, 16)).unscale == 1.0


CASES = [
    # (out, in, scheme, act_order, bias)
    (64, 128, Scheme(4, 32, sym=False), False, False),
    (48, 256, Scheme(4, 64, sym=True), False, True),
    (40, 576, Scheme(4, 128, sym=False), False, False),  # ragged last group, N % 16 != 0
    (33, 512, Scheme(4, 256, sym=False), False, False),
    (64, 256, Scheme(4, 64, sym=False), True, False),  # act-order: permuted input
    (17, 96, Scheme(4, -1, sym=False), False, True),  # per channel, K = 3 blocks
    (64, 192, Scheme(8, -1, sym=False), False, True),
    (40, 160, Scheme(8, 32, sym=True), False, False),
    (24, 128, Scheme(8, 64, sym=False), True, False),
    (64, 256, Scheme(4, 64, format="nf4"), False, False),  # nf4: 4-bit codes through the kernel's table
    (40, 576, Scheme(4, 128, format="nf4"), True, True),
    (17, 96, Scheme(4, -1, format="nf4"), False, False),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 3, 8, 9, 20])
@pytest.mark.parametrize("out_f,in_f,scheme,act_order,bias", CASES)
def test_kernel_matches_reference_and_quantlinear(out_f, in_f, scheme, act_order, bias, m, dtype):
    ql = random_qlinear(out_f, in_f, scheme, act_order, bias, seed=m)
    assert w8a8.fits(ql)
    kernel = prepare_linear(ql, "packed", dtype, fused=True)
    assert kernel.path == "w8a8"
    x = torch.randn(m, in_f, generator=torch.Generator().manual_seed(1)).to(dtype)
    out = kernel(x)
    assert out.shape == (m, out_f) and out.dtype == dtype
    # the same computation in torch: activations rounded to int8 per block of 32, integer dot products
    xs = x.float()
    if kernel.perm is not None:
        xs = xs[:, kernel.perm]
    xs = torch.nn.functional.pad(xs, (0, kernel.k_pad))
    codes, (scale, szero), lut = ql.codes(), kernel.scales(), kernel.lut
    if lut is not None:
        codes = lut[codes.long()]
    if kernel.perm is not None:
        codes = codes[:, kernel.perm]
    codes = torch.nn.functional.pad(codes, (0, kernel.k_pad))
    ref = w8a8.w8a8_reference(xs, codes, scale, szero, kernel.group)
    if bias:
        ref = ref + ql.bias.float()
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: the output's own rounding
    assert torch.allclose(out.float(), ref, rtol=tol, atol=tol * ref.abs().max().item()), (out.float() - ref).abs().max()
    # and close to the exact product: only the int8 rounding of the activations differs
    exact = ql(x.float())
    err = (out.float() - exact).norm() / exact.norm()
    assert err < 2e-2, err


@pytest.mark.parametrize("magnitude", [1.0, 1e-4, 1e3])  # 1e-4: NF4's scale / 127 would be subnormal in fp16
@pytest.mark.parametrize("scheme", [Scheme(4, 64, sym=False), Scheme(8, -1, sym=True), Scheme(4, 64, format="nf4")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_is_dequantize_then_matmul_with_the_fp16_scales(scheme, magnitude, dtype):
    ql = random_qlinear(40, 256, scheme, seed=5)
    ql.scales.mul_(magnitude)
    kernel = w8a8.W8A8Linear(ql)
    assert kernel.scale.dtype == kernel.szero.dtype == torch.float16
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(2)).to(dtype)
    xq, sa = w8a8.quantize_activations(x)  # the int8 activations the kernel makes, dequantized
    xd = (xq.reshape(3, -1, w8a8.BLOCK) * sa[..., None]).reshape(3, 256)
    w = w8a8.dequant_tiles(kernel.weight, kernel.scale, kernel.szero, kernel.bits, kernel.group, 40, kernel.lut,
                           kernel.unscale)
    ref = xd.double() @ w.double().T
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: the output's own rounding
    torch.testing.assert_close(kernel(x).double(), ref, rtol=tol, atol=tol * ref.abs().max().item())
    # and the weight the same codes make with fp32 scales, within fp16's rounding of scale and scale * zero
    scale, zero, lut = w8a8.kernel_scales(ql)
    codes = ql.codes() if lut is None else lut[ql.codes().long()]
    w32 = (codes.float() - zero.repeat_interleave(kernel.group, 1)) * scale.repeat_interleave(kernel.group, 1)
    assert (w - w32).norm() / w32.norm() < 2 ** -11


def test_zero_activations_and_zero_scales():
    ql = random_qlinear(32, 128, Scheme(4, 32, sym=False))
    ql.scales[:, 1] = 0  # a group whose weights are all zero
    kernel = prepare_linear(ql, "packed", torch.float32, fused=True)
    x = torch.zeros(2, 128)
    x[1, 40:50] = 1.0
    out = kernel(x)
    assert (out[0] == 0).all()  # an all-zero block has scale 0, not NaN
    assert torch.allclose(out[1], ql(x)[1], atol=1e-3)  # the only nonzero block falls in the zeroed group


def test_larger_calls_use_the_dense_gemm_in_auto_mode():
    ql = random_qlinear(64, 128, Scheme(4, 32, sym=False))
    kernel = prepare_linear(ql, "auto", torch.bfloat16, fused=True)
    x = torch.randn(64, 128, dtype=torch.bfloat16)
    err = (kernel(x).float() - ql(x.float())).norm() / ql(x.float()).norm()
    assert err < 1e-2


def test_without_vnni_the_int4pack_path_runs(monkeypatch):
    monkeypatch.setattr(w8a8, "available", lambda: False)
    ql = random_qlinear(64, 128, Scheme(4, 32, sym=False))
    assert prepare_linear(ql, "packed", torch.float32, fused=True).path == "int4pack"


def test_nf4_table_is_the_codebook_within_a_tenth_of_its_finest_half_step():
    from compress.format.quant import nf4_codebook

    table = (w8a8.nf4_table().float() - 128) / w8a8.NF4_UNIT
    cb = nf4_codebook()
    assert (table - cb).abs().max() <= 0.5 / w8a8.NF4_UNIT + 1e-7
    assert (table - cb).abs().max() < 0.1 * (cb.diff().min() / 2)
    assert table[7] == 0 and table[0] == -1 and table[15] == 1  # exact zero and ends


DEQUANT_CASES = [(48, 128, Scheme(4, 32, sym=False), None), (40, 96, Scheme(8, -1, sym=True), None),
                 (33, 64, Scheme(4, 64, sym=True), None), (32, 128, Scheme(4, 32, format="nf4"), None)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_f,in_f,scheme,_", DEQUANT_CASES)
def test_dequant_kernel_is_the_reference_and_the_quantlinear_weight(out_f, in_f, scheme, _, dtype):
    ql = random_qlinear(out_f, in_f, scheme)
    kernel = w8a8.W8A8Linear(ql)
    ref = w8a8.dequant_tiles(kernel.weight, kernel.scale, kernel.szero, scheme.bits, kernel.group, out_f, kernel.lut,
                             kernel.unscale)
    out = kernel.dequantize_into(torch.full((out_f, in_f), float("nan"), dtype=dtype))  # every element written
    assert torch.equal(out, ref.to(dtype))  # one rounding of code * scale - scale * zero
    # fp16 scale and scale * zero: each off by at most 2^-11 of itself, so a weight by 2^-11 (|code| + |zero|) scale
    tol = 2 ** -11 * 2 * (2 ** scheme.bits if scheme.format == "int" else 255)
    tol = tol if scheme.format == "int" else tol + 2.5e-3  # nf4: the kernel's 8-bit table (see nf4_table)
    exact = ql.dequantized_weight(torch.float32)
    step = ql.scales.float().repeat_interleave(kernel.group, dim=1)[:, :in_f]
    assert ((ref - exact).abs() <= tol * step).all()


@pytest.mark.parametrize("bits,scheme", [(4, Scheme(4, 32, sym=False)), (8, Scheme(8, -1, sym=True))])
def test_gather_codes_reads_any_rows_from_the_tiles(bits, scheme):
    ql = random_qlinear(50, 96, scheme)
    tiles = w8a8.W8A8Linear(ql).weight
    ids = torch.tensor([0, 49, 17, 17, 16, 31])
    assert torch.equal(w8a8.gather_codes(tiles, ids, bits, 96), ql.codes()[ids])


def test_tile_codes_in_slabs_equal_one_pack(monkeypatch):
    ql = random_qlinear(100, 64, Scheme(4, 32, sym=False))
    whole = w8a8.pack_tiles(ql.codes(), 4)
    monkeypatch.setattr(w8a8, "SLAB_ROWS", 32)
    assert torch.equal(w8a8.tile_codes(ql, None, 0), whole)


def test_scratch_linear_runs_the_dense_product_from_one_shared_buffer():
    scratch = w8a8.Scratch()
    qls = [random_qlinear(64, 128, Scheme(4, 32, sym=False), seed=1),
           random_qlinear(96, 64, Scheme(8, -1, sym=True), bias=True, seed=2)]
    for ql in qls:
        lin = w8a8.ScratchLinear(w8a8.W8A8Linear(ql), scratch)
        x = torch.randn(40, ql.in_features, generator=torch.Generator().manual_seed(3))
        k = lin.kernel
        w = w8a8.dequant_tiles(k.weight, k.scale, k.szero, k.bits, k.group, k.out_features, k.lut, k.unscale)
        want = torch.nn.functional.linear(x.bfloat16(), w.bfloat16(), None if ql.bias is None else ql.bias.bfloat16())
        assert torch.equal(lin(x.bfloat16()), want)  # the same bf16 weights, the same GEMM
    assert scratch.buf.numel() == 64 * 128  # the largest linear's weight, held once


def test_auto_keeps_no_copy_where_the_vnni_kernel_is_fastest(monkeypatch):
    from runtime.kernels import qmatmul

    ql = random_qlinear(64, 128, Scheme(4, 32, sym=False))
    monkeypatch.setattr(qmatmul, "cpu_info", lambda: type("Info", (), {"amx_bf16": False})())
    assert prepare_linear(ql, "auto", torch.bfloat16, fused=True).path == "w8a8"
    monkeypatch.setattr(qmatmul, "cpu_info", lambda: type("Info", (), {"amx_bf16": True})())
    if qmatmul.mkldnn_bf16_available():
        assert prepare_linear(ql, "auto", torch.bfloat16, fused=True).path == "w8a8+scratch"
        assert prepare_linear(ql, "hybrid", torch.bfloat16, fused=True).path == "w8a8+mkldnn"
