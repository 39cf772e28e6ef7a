"""GPTQ's Hessian (compress/methods/common/hessian.py): the panelled lower-triangle product is x^T x, symmetric; with
bfloat16 products, the float32 Gram of the bfloat16-rounded inputs (the native kernel or not)."""
from __future__ import annotations

import pytest
import torch

from compress.methods.common import hessian
from compress.methods.common.hessian import Hessian, add_gram_


@pytest.mark.parametrize("n, width", [(40, 64), (64, 16), (70, 16), (130, 32)])  # one panel, even, ragged last panel
def test_panelled_gram_is_the_full_product(n, width):
    x = torch.randn(300, n, generator=torch.Generator().manual_seed(n))
    start = torch.randn(n, n, generator=torch.Generator().manual_seed(1))
    start = start @ start.T  # an accumulated Hessian: symmetric
    want = start.clone().addmm_(x.T, x)
    got = add_gram_(start.clone(), x, width)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)
    assert torch.equal(got, got.T)  # mirrored, not two products that may round apart


def test_hessian_accumulates_the_mean_of_2_x_xT_in_panels():
    x = torch.randn(2, 50, 700, generator=torch.Generator().manual_seed(0))  # wider than one panel
    h = Hessian.zeros(700)
    h.add(x[0])
    h.add(x[1])
    flat = x.reshape(-1, 700)
    torch.testing.assert_close(h.H, 2 * flat.T @ flat / 100, rtol=1e-4, atol=1e-4)
    assert h.n == 100 and torch.equal(h.H, h.H.T)


@pytest.mark.parametrize("native", [True, False])
def test_bf16_products_are_the_gram_of_the_rounded_inputs(native, monkeypatch):
    if not native:
        monkeypatch.setattr(hessian, "_bf16_kernel", lambda: False)
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 40, 96, generator=g), torch.rand(3, 40, generator=g) + 0.5
    h, weighted = Hessian.zeros(96, torch.bfloat16), Hessian.zeros(96, torch.bfloat16)
    for i in range(3):
        h.add(x[i])
        weighted.add(x[i], w[i])
    r = x.reshape(-1, 96).bfloat16().double()
    rw = (x * w[..., None].sqrt()).reshape(-1, 96).bfloat16().double()
    torch.testing.assert_close(h.H, (2 * r.T @ r / 120).float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(weighted.H, (2 * rw.T @ rw / 120).float(), rtol=1e-5, atol=1e-5)
    assert torch.equal(h.H, h.H.T) and h.n == 120
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        Hessian.zeros(4, torch.float16)
