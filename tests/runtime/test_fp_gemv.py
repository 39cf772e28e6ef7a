"""The fp32 GEMV kernel (runtime/kernels/cpu/fp_gemv.cpp) against F.linear."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from runtime.kernels import cpu_ext
from runtime.kernels.fp_gemv import MAX_ROWS, GemvLinear
from runtime.kernels.qmatmul import pack_dense_linears


@pytest.fixture(scope="module", autouse=True)
def kernels():
    if not cpu_ext.load():
        pytest.skip("the fused CPU kernels do not build here")


@pytest.mark.parametrize("n,k", [(1, 1), (7, 15), (33, 64), (100, 77), (64, 576), (17, 1000)])
@pytest.mark.parametrize("rows", [1, 2, MAX_ROWS, MAX_ROWS + 3])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_f_linear(n, k, rows, bias):
    g = torch.Generator().manual_seed(n * k + rows)
    w, b = torch.randn(n, k, generator=g), torch.randn(n, generator=g) if bias else None
    x = torch.randn(rows, k, generator=g)
    ref = F.linear(x, w, b)
    got = GemvLinear(w, b)(x)
    assert got.shape == ref.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


def test_leading_dims_and_the_op_itself():
    w, x = torch.randn(24, 40), torch.randn(1, 3, 40)
    torch.testing.assert_close(GemvLinear(w, None)(x), F.linear(x, w), rtol=1e-5, atol=1e-5)
    y = torch.ops.compress_cpu.fp32_gemv(x[0], w, None)
    torch.testing.assert_close(y, x[0] @ w.T, rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="fp32"):
        torch.ops.compress_cpu.fp32_gemv(x[0].bfloat16(), w.bfloat16(), None)


def test_pack_dense_linears_takes_fp32_only_with_the_fused_kernels():
    model = nn.Sequential(nn.Linear(32, 16), nn.Linear(16, 8, bias=False))
    assert pack_dense_linears(model, torch.float32, fused=False) == 0
    x = torch.randn(2, 32)
    ref = model(x)
    assert pack_dense_linears(model, torch.float32, fused=True) == 2
    assert all(isinstance(m, GemvLinear) for m in model)
    torch.testing.assert_close(model(x), ref, rtol=1e-5, atol=1e-5)
