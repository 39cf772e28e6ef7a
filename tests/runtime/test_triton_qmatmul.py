"""The Triton dequant-GEMM against dequantize + matmul, under TRITON_INTERPRET=1 on CPU tensors."""
import os

import pytest
import torch

from compress.format.qlinear import QuantLinear
from compress.format.quant import QuantizedWeight, Scheme, compute_qparams, quantize


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # on CPU: TRITON_INTERPRET=1 (tests/conftest.py)


@pytest.fixture(scope="module")
def tq():
    if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.fail("Triton kernels need TRITON_INTERPRET=1 without CUDA; tests/conftest.py sets it before Triton loads")
    import runtime.kernels.triton_qmatmul as tq
    return tq


def make_linear(out_f: int, in_f: int, scheme: Scheme, act_order: bool, bias: bool, gen: torch.Generator) -> QuantLinear:
    w = torch.randn(out_f, in_f, generator=gen)
    scale, zero = compute_qparams(w, scheme)
    g_idx = None
    if act_order:  # a random column -> group map, as GPTQ's act-order leaves behind
        g_idx = torch.randint(0, scheme.n_groups(in_f), (in_f,), generator=gen)
    q = quantize(w, scale, zero, scheme, g_idx)
    b = torch.randn(out_f, generator=gen) if bias else None
    return QuantLinear.from_quantized(QuantizedWeight(q, scale, zero, scheme, g_idx), bias=b).to(DEVICE)


def run(tq, lin: QuantLinear, x: torch.Tensor) -> torch.Tensor:
    return tq.triton_qmatmul(x, lin.qweight, lin.scales, lin.qzeros, lin.scheme, lin.in_features, lin.g_idx, lin.bias)


SCHEMES = [
    Scheme(bits=4, group_size=32, sym=False),
    Scheme(bits=4, group_size=32, sym=True),
    Scheme(bits=4, group_size=-1, sym=False),
    Scheme(bits=4, group_size=32, format="nf4"),
    Scheme(bits=8, group_size=16, sym=False),
    Scheme(bits=3, group_size=16, sym=False),
    Scheme(bits=2, group_size=16, sym=True),
]


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: f"b{s.bits}g{s.group_size}{'s' if s.sym else 'a'}{s.format}")
@pytest.mark.parametrize("m", [1, 5, 19])
def test_matches_dequantized_matmul(tq, scheme, m):
    gen = torch.Generator().manual_seed(m * 31 + scheme.bits)
    in_f = 72  # not a multiple of 32 or 64: a ragged last group and a partly filled last word
    lin = make_linear(80, in_f, scheme, act_order=False, bias=True, gen=gen)
    x = torch.randn(m, in_f, generator=gen).to(DEVICE)
    ref = torch.nn.functional.linear(x, lin.dequantized_weight(torch.float32), lin.bias)
    torch.testing.assert_close(run(tq, lin, x), ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("bits", [4, 3])
def test_act_order_g_idx(tq, bits):
    gen = torch.Generator().manual_seed(bits)
    lin = make_linear(48, 96, Scheme(bits=bits, group_size=32), act_order=True, bias=False, gen=gen)
    x = torch.randn(2, 3, 96, generator=gen).to(DEVICE)  # leading dims are kept
    ref = x @ lin.dequantized_weight(torch.float32).T
    out = run(tq, lin, x)
    assert out.shape == (2, 3, 48)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


def test_fp16_activations(tq):
    gen = torch.Generator().manual_seed(7)
    lin = make_linear(64, 64, Scheme(bits=4, group_size=32), act_order=False, bias=False, gen=gen)
    x = torch.randn(4, 64, generator=gen).half().to(DEVICE)
    ref = x.float() @ lin.dequantized_weight(torch.float16).float().T
    out = run(tq, lin, x)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)


def test_rejects_wrong_in_features(tq):
    lin = make_linear(16, 32, Scheme(bits=4, group_size=16), act_order=False, bias=False, gen=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="in_features=32"):
        run(tq, lin, torch.randn(1, 31, device=DEVICE))


@pytest.mark.parametrize("act_order", [False, True])
def test_engine_module_equals_quant_linear_forward(tq, act_order):
    """The engine's CUDA module (runtime/kernels/qmatmul.TritonLinear) computes QuantLinear.forward's numbers."""
    from runtime.kernels.qmatmul import TritonLinear

    gen = torch.Generator().manual_seed(11)
    lin = make_linear(40, 72, Scheme(bits=4, group_size=32), act_order=act_order, bias=True, gen=gen)
    x = torch.randn(3, 72, generator=gen).to(DEVICE)
    torch.testing.assert_close(TritonLinear(lin)(x), lin(x), rtol=1e-4, atol=1e-4)
