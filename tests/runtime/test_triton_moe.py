"""The Triton grouped MoE GEMM against the torch experts path, under TRITON_INTERPRET=1 on CPU tensors."""
import os

import pytest
import torch

from compress.format import quant
from compress.format.moe_packed import PackedLinears
from compress.format.quant import QuantizedWeight, Scheme, compute_qparams, quantize
from runtime.kernels.moe import StackedLinears, torch_experts

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # on CPU: TRITON_INTERPRET=1 (tests/conftest.py)
E, H, I = 4, 40, 24  # H, I not multiples of the tiles: ragged K and N edges


@pytest.fixture(scope="module")
def tm():
    if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.fail("Triton kernels need TRITON_INTERPRET=1 without CUDA; tests/conftest.py sets it before Triton")
    import runtime.kernels.triton_moe as tm
    return tm


def _routing(T: int, k: int, gen: torch.Generator):
    """Distinct top-k experts per token: expert 0 on every token (its run passes one tile), expert 3 idle."""
    rows = []
    for _ in range(T):
        perm = torch.randperm(E - 1, generator=gen)
        rows.append(torch.cat([torch.zeros(1, dtype=torch.long), perm[perm != 0]])[:k])
    index = torch.stack(rows)
    index[-1, -1] = E  # a masked slot (transformers' expert-parallel padding index) contributes nothing
    return index, torch.rand(T, k, generator=gen).softmax(-1)


def _packed(out_f: int, in_f: int, scheme: Scheme, act_order: bool, gen: torch.Generator) -> PackedLinears:
    weights = []
    for _ in range(E):
        w = torch.randn(out_f, in_f, generator=gen)
        if not act_order:
            weights.append(quant.quantize_weight(w, scheme))
            continue
        g_idx = torch.randint(0, scheme.n_groups(in_f), (in_f,), generator=gen)  # GPTQ act-order leaves these
        scale, zero = compute_qparams(w, scheme)
        weights.append(QuantizedWeight(quantize(w, scale, zero, scheme, g_idx), scale, zero, scheme, g_idx))
    return PackedLinears.from_quantized(weights)


def _check(tm, gate_up, down, T: int, k: int, seed: int, dtype=torch.float32, tol=1e-4):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=gen)
    index, weights = _routing(T, k, gen)
    ref = torch_experts(x, index, weights, gate_up, down, torch.nn.functional.silu)
    gate_up, down = gate_up.to(DEVICE), down.to(DEVICE)
    out = tm.triton_moe_forward(x.to(DEVICE, dtype), index.to(DEVICE), weights.to(DEVICE, dtype), gate_up, down,
                                torch.nn.functional.silu)
    assert out.dtype == dtype and out.shape == x.shape
    if dtype == torch.float32:
        torch.testing.assert_close(out.cpu(), ref, rtol=tol, atol=tol)
    else:  # fp16 rounding of activations and products: compare as a whole
        assert (out.float().cpu() - ref).norm() / ref.norm() < tol


@pytest.mark.parametrize("T", [1, 3, 70])  # decode, a few tokens, and expert 0 past one 64-row tile
def test_fp_experts_match_torch(tm, T):
    gen = torch.Generator().manual_seed(T)
    gate_up = StackedLinears(torch.randn(E, 2 * I, H, generator=gen) * 0.2)
    down = StackedLinears(torch.randn(E, H, I, generator=gen) * 0.2)
    _check(tm, gate_up, down, T, 2, seed=T)


SCHEMES = [Scheme(4, 16), Scheme(4, 16, sym=True), Scheme(4, -1), Scheme(4, 16, format="nf4"), Scheme(8, 16),
           Scheme(3, 16)]


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: f"b{s.bits}g{s.group_size}{'s' if s.sym else 'a'}{s.format}")
def test_packed_experts_match_torch(tm, scheme):
    gen = torch.Generator().manual_seed(scheme.bits)
    gate_up, down = _packed(2 * I, H, scheme, False, gen), _packed(H, I, scheme, False, gen)
    _check(tm, gate_up, down, 21, 2, seed=5)


def test_act_order_packed_experts(tm):
    gen = torch.Generator().manual_seed(3)
    scheme = Scheme(4, 8)
    gate_up, down = _packed(2 * I, H, scheme, True, gen), _packed(H, I, scheme, True, gen)
    assert gate_up.g_idx is not None
    _check(tm, gate_up, down, 6, 3, seed=6)


def test_tiles_never_straddle_experts(tm):
    experts, starts, ends = tm.tile_table([17, 0, 3, 16], 16, "cpu")
    assert experts.tolist() == [0, 0, 2, 3] and starts.tolist() == [0, 16, 17, 20] and ends.tolist() == [17, 17, 20, 36]


def test_half_precision_activations(tm):
    gen = torch.Generator().manual_seed(9)
    gate_up, down = _packed(2 * I, H, Scheme(4, 16), False, gen), _packed(H, I, Scheme(4, 16), False, gen)
    _check(tm, gate_up, down, 5, 2, seed=9, dtype=torch.float16, tol=5e-3)


@pytest.mark.parametrize("family", ["qwen2_moe", "mixtral"])
def test_runner_selects_triton_experts_on_cuda(tm, family):
    """prepare_experts routes every MoE layer to the Triton kernel on CUDA; the model's outputs stay those of
    the torch experts path (run here through the interpreter)."""
    from test_sparse_moe import hf_moe, runtime_model

    from runtime.kernels.moe import prepare_experts, triton_experts

    model = runtime_model(hf_moe(family, {}))
    x = torch.randn(7, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = [m(x) for m in model.moe_modules()]
        assert prepare_experts(model, "auto", "cuda") == {"experts-triton": 2}
        assert all(m.experts_fn is triton_experts for m in model.moe_modules())
        model.to(DEVICE)
        for m, r in zip(model.moe_modules(), ref):
            torch.testing.assert_close(m(x.to(DEVICE)).cpu(), r, rtol=1e-4, atol=1e-4)
