"""The bf16 Gram kernel (runtime/kernels/cpu/gram.cpp) against float32 products of the same bf16 values: ragged
strips and token counts, an accumulated start, exact symmetry, and a positive definite sum where torch's bf16
matmul (its output rounded to bf16) is not."""
import pytest
import torch

from runtime.kernels import cpu_ext


@pytest.fixture(scope="module", autouse=True)
def kernels():
    if not cpu_ext.load() or not torch.ops.compress_cpu.has_bf16_dot():
        pytest.skip("no native bf16 Gram here (the kernels do not build, or no AVX512-BF16)")


# one tile, ragged rows and columns, more than one 512-token block, an odd token count
@pytest.mark.parametrize("tokens,n", [(2, 12), (31, 40), (600, 100), (1025, 257), (513, 576)])
def test_matches_float32_products_of_the_same_values(tokens, n):
    g = torch.Generator().manual_seed(tokens + n)
    x = torch.randn(tokens, n, generator=g).bfloat16()
    start = torch.randn(n, n, generator=g)
    start = start @ start.T
    want = start + 0.5 * (x.double().T @ x.double()).float()
    got = start.clone()
    torch.ops.compress_cpu.gram_bf16_(got, x, 0.5)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5 * want.abs().max().item())
    assert torch.equal(got, got.T)


def test_positive_definite_where_a_rounded_bf16_product_is_not():
    # nearly collinear inputs: the Gram's smallest eigenvalue is far below bf16's resolution of its largest
    g = torch.Generator().manual_seed(0)
    base = torch.randn(4096, 1, generator=g)
    x = (base + 1e-2 * torch.randn(4096, 64, generator=g)).bfloat16()
    h = torch.zeros(64, 64)
    torch.ops.compress_cpu.gram_bf16_(h, x, 1.0 / 4096)
    exact = (x.double().T @ x.double()) / 4096
    smallest = torch.linalg.eigvalsh(exact).min()
    torch.testing.assert_close(torch.linalg.eigvalsh(h.double()).min(), smallest, rtol=0.05, atol=0)
    rounded = ((x.T @ x).double() / 4096)  # bf16 output
    assert torch.linalg.eigvalsh(rounded).min() < 0


def test_refuses_other_dtypes_and_shapes():
    with pytest.raises(RuntimeError, match="fp32 h, bf16 x"):
        torch.ops.compress_cpu.gram_bf16_(torch.zeros(4, 4), torch.zeros(3, 4), 1.0)
    with pytest.raises(RuntimeError, match=r"x \[tokens, n\], h \[n, n\]"):
        torch.ops.compress_cpu.gram_bf16_(torch.zeros(4, 4), torch.zeros(3, 5).bfloat16(), 1.0)
