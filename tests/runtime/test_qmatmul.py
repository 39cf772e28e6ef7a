"""Every CPU quantized-matmul path against QuantLinear.forward on the same integers."""
import pytest
import torch

from compress.format.qlinear import QuantLinear
from compress.format.quant import QuantizedWeight, Scheme
from runtime.kernels.qmatmul import packed_path, prepare_linear


def random_qlinear(out_f, in_f, scheme, act_order=False, bias=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    n_groups = scheme.n_groups(in_f)
    q = torch.randint(0, 2 ** scheme.bits, (out_f, in_f), generator=g).to(torch.uint8)
    scale = (torch.rand(out_f, n_groups, generator=g) * 0.02 + 0.001).half()
    zero = None
    if scheme.has_zeros:
        zero = torch.randint(0, 2 ** scheme.bits, (out_f, n_groups), generator=g).to(torch.uint8)
    g_idx = None
    if act_order:
        perm = torch.randperm(in_f, generator=g)
        g_idx = torch.empty(in_f, dtype=torch.int32)
        g_idx[perm] = (torch.arange(in_f) // scheme.group(in_f)).to(torch.int32)
    b = torch.randn(out_f, generator=g) if bias else None
    return QuantLinear.from_quantized(QuantizedWeight(q, scale, zero, scheme, g_idx), bias=b)


PACKED = [
    # (out, in, scheme, act_order, bias, expected path)
    (64, 128, Scheme(4, 32, sym=False), False, False, "int4pack"),
    (48, 256, Scheme(4, 64, sym=True), False, True, "int4pack"),
    (40, 576, Scheme(4, 128, sym=False), False, False, "int4pack"),  # ragged last group, N % 16 != 0
    (32, 512, Scheme(4, 256, sym=False), False, False, "int4pack"),
    (64, 256, Scheme(4, 64, sym=False), True, False, "int4pack"),  # act-order: permuted input
    (64, 192, Scheme(8, -1, sym=False), False, True, "int8pack"),
    (40, 72, Scheme(8, -1, sym=True), False, False, "int8pack"),  # K padded to 64s
]
DENSE = [
    (32, 96, Scheme(4, 16, sym=False)),  # group 16: no int4 kernel
    (32, 96, Scheme(3, 32, sym=False)),
    (32, 96, Scheme(2, 32, sym=True)),
    (32, 96, Scheme(4, 32, format="nf4")),
    (32, 96, Scheme(8, 32, sym=False)),  # grouped int8
]


@pytest.mark.parametrize("m", [1, 5, 33])
@pytest.mark.parametrize("out_f,in_f,scheme,act_order,bias,path", PACKED)
def test_packed_paths_match_quantlinear(out_f, in_f, scheme, act_order, bias, path, m):
    ql = random_qlinear(out_f, in_f, scheme, act_order, bias)
    assert packed_path(ql) == path
    kernel = prepare_linear(ql, "packed", torch.float32)
    assert kernel.path == path
    x = torch.randn(m, in_f, generator=torch.Generator().manual_seed(1))
    ref = ql(x)
    out = kernel(x)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    # bf16 activations inside the kernel: relative error of bf16 rounding, not of a wrong layout
    err = (out - ref).norm() / ref.norm()
    assert err < 1e-2, err
    # a layout bug (wrong zero, group or column order) is far outside that bound
    other = random_qlinear(out_f, in_f, scheme, act_order, bias, seed=5)(x)
    assert (other - ref).norm() / ref.norm() > 0.1


@pytest.mark.parametrize("out_f,in_f,scheme", DENSE)
def test_dense_fallback_is_exact(out_f, in_f, scheme):
    ql = random_qlinear(out_f, in_f, scheme, bias=True)
    assert packed_path(ql) == "dense"
    kernel = prepare_linear(ql, "packed", torch.float32)
    assert kernel.path == "dense"
    x = torch.randn(7, in_f)
    torch.testing.assert_close(kernel(x), ql(x), rtol=1e-6, atol=1e-6)


def test_dequant_mode_is_exact_for_int4():
    ql = random_qlinear(64, 128, Scheme(4, 32))
    kernel = prepare_linear(ql, "dequant", torch.float32)
    assert kernel.path == "dense"
    x = torch.randn(3, 128)
    torch.testing.assert_close(kernel(x), ql(x), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("scheme,small", [(Scheme(4, 64), "int4pack"), (Scheme(8, -1), "int8pack")])
def test_auto_routes_small_calls_to_the_packed_kernel_and_large_ones_to_bf16(scheme, small):
    from runtime.kernels.qmatmul import HybridLinear, mkldnn_bf16_available

    if not mkldnn_bf16_available():
        pytest.skip("no prepacked bf16 linears on this CPU/torch")
    ql = random_qlinear(48, 256, scheme, bias=True)
    kernel = prepare_linear(ql, "auto", torch.float32)
    assert isinstance(kernel, HybridLinear) and kernel.path == f"{small}+mkldnn"
    for m in (1, kernel.max_rows, kernel.max_rows + 1, 64):
        x = torch.randn(m, 256)
        ref = ql(x)
        assert (kernel(x) - ref).norm() / ref.norm() < 1e-2
    calls = []

    def spy(name, forward):
        return lambda x: calls.append(name) or forward(x)

    kernel._forwards = (spy("small", kernel._forwards[0]), spy("large", kernel._forwards[1]))  # called directly
    kernel(torch.randn(1, 256))
    kernel(torch.randn(2, 40, 256))
    assert calls == ["small", "large"]


def test_hybrid_mode_is_the_old_auto_for_the_aten_kernels():
    from runtime.kernels.qmatmul import mkldnn_bf16_available

    if not mkldnn_bf16_available():
        pytest.skip("no prepacked bf16 linears on this CPU/torch")
    ql = random_qlinear(48, 256, Scheme(4, 64))
    assert prepare_linear(ql, "hybrid", torch.float32).path == prepare_linear(ql, "auto", torch.float32).path
