"""The fused CPU kernels (runtime/kernels/cpu/fused_ops.cpp) against the torch reference ops, on random inputs
with odd shapes, both dtypes; and the engine's greedy tokens on the fused path equal the torch path's."""
import pytest
import torch

from runtime.config import EngineConfig
from runtime.engine import Engine
from runtime.kernels import cpu_ext
from runtime.kernels.attention import AttentionMetadata, decode_attention, fused_paged_attention, write_kv
from runtime.kernels.fused import ACTIVATIONS, FUSED_CPU_OPS, TORCH_OPS, select_ops
from runtime.model_runner import ForwardItem, ModelRunner
from runtime.models.layers import Rotary
from runtime.models.loader import open_checkpoint
from runtime.sequence import SamplingParams
from tiny_engine import prompts, save_tiny
from tiny_models import FAMILIES, MOE_FAMILIES

pytestmark = pytest.mark.skipif(not cpu_ext.load(), reason="the fused CPU kernels did not build here")
DTYPES = [torch.float32, torch.bfloat16]


def _close(a, b, dtype, ulps: int = 2):
    """fp32: accumulation order only; bf16: a couple of bf16 roundings apart."""
    if dtype == torch.float32:
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(a.float(), b.float(), rtol=ulps * 2 ** -8, atol=ulps * 2 ** -8)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 64), (7, 96), (3, 5, 577)])
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_rms_norm(dtype, shape, offset):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(shape, generator=g) * 3).to(dtype)
    w = torch.randn(shape[-1], generator=g).to(dtype)
    _close(FUSED_CPU_OPS.rms_norm(x, w, 1e-6, offset), TORCH_OPS.rms_norm(x, w, 1e-6, offset), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_updates_the_residual_like_the_reference(dtype):
    g = torch.Generator().manual_seed(1)
    x, d = torch.randn(5, 130, generator=g).to(dtype), torch.randn(5, 130, generator=g).to(dtype)
    w = torch.randn(130, generator=g).to(dtype)
    r1, r2 = x.clone(), x.clone()
    out = FUSED_CPU_OPS.add_rms_norm_(r1, d, w, 1e-5, 0.0)
    ref = TORCH_OPS.add_rms_norm_(r2, d, w, 1e-5, 0.0)
    assert torch.equal(r1, r2)  # the residual add rounds exactly like eager ``x + d``
    _close(out, ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", sorted(ACTIVATIONS))
@pytest.mark.parametrize("rows,inter", [(1, 48), (9, 37)])
def test_act_mul(dtype, act, rows, inter):
    gu = (torch.randn(rows, 2 * inter, generator=torch.Generator().manual_seed(2)) * 4).to(dtype)
    _close(FUSED_CPU_OPS.act_mul(gu, act), TORCH_OPS.act_mul(gu, act), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_in_place_matches_reference(dtype):
    g = torch.Generator().manual_seed(3)
    t, heads, rotated, d = 6, 7, 5, 32  # the last two heads (v) must stay untouched
    x = torch.randn(t, heads, d, generator=g).to(dtype)
    cos, sin = Rotary(d, 10000.0, None, 128)(torch.tensor([0, 1, 5, 9, 64, 127]), dtype)
    ref = TORCH_OPS.rope(x.clone(), cos, sin, rotated)
    out = FUSED_CPU_OPS.rope(x.clone(), cos, sin, rotated)
    assert torch.equal(out[:, :rotated], ref)  # same roundings, no fused multiply-add: bit-identical
    assert torch.equal(out[:, rotated:], x[:, rotated:])


def _paged(seq_lens, hq, hkv, d, block_size, dtype, seed=0, num_blocks=64):
    """A shuffled paged KV pool holding each sequence's keys, with its metadata for one decode query each."""
    g = torch.Generator().manual_seed(seed)
    tables = []
    free = torch.randperm(num_blocks, generator=g).tolist()
    for n in seq_lens:
        tables.append([free.pop() for _ in range(-(-n // block_size))])
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    k_cache = torch.zeros(num_blocks, block_size, hkv, d, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    for b, n in enumerate(seq_lens):
        slots = torch.tensor([tables[b][p // block_size] * block_size + p % block_size for p in range(n)])
        write_kv(k_cache, v_cache, torch.randn(n, hkv, d, generator=g).to(dtype),
                 torch.randn(n, hkv, d, generator=g).to(dtype), slots)
    q = torch.randn(len(seq_lens), hq, d, generator=g).to(dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.long), num_prefill_tokens=0,
        prefill_cu_seqlens_q=torch.zeros(1, dtype=torch.int32), prefill_seq_lens=torch.zeros(0, dtype=torch.int32),
        prefill_block_tables=torch.zeros(0, 0, dtype=torch.int32), prefill_q_lens=[], prefill_ctx_lens=[],
        decode_q_lens=[1] * len(seq_lens), decode_cu_seqlens_q=torch.arange(len(seq_lens) + 1, dtype=torch.int32),
        decode_seq_lens=lens, decode_block_tables=bt, max_decode_seq_len=max(seq_lens))
    return q, k_cache, v_cache, meta


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seq_lens,hq,hkv,block_size,window", [
    ([1], 4, 4, 16, None),
    ([37, 5, 200, 16], 9, 3, 16, None),  # GQA groups of 3, ragged lengths, a block boundary
    ([33, 70], 8, 1, 8, 12),  # MQA with a sliding window shorter than the sequences
    ([3], 6, 2, 4, 40),  # a window no sequence reaches
])
def test_paged_decode_attention(dtype, seq_lens, hq, hkv, block_size, window):
    q, kc, vc, meta = _paged(seq_lens, hq, hkv, 24, block_size, dtype)
    ref = decode_attention(q, kc, vc, meta, 0.2, window)
    strided = torch.cat([q, torch.ones_like(q[:, :2])], dim=1)[:, :hq]  # q as the model hands it: a slice of qkv
    out = torch.ops.compress_cpu.paged_decode_attention(strided, kc, vc, meta.decode_block_tables,
                                                        meta.decode_seq_lens, 0.2, window or 0)
    _close(out, ref, dtype, ulps=4)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seq_lens,hq,hkv,d,window", [
    ([2000], 9, 3, 64, None),  # one long sequence: its keys split across threads, chunks merged
    ([700, 3, 1300], 4, 1, 24, None),  # split and whole sequences in one call, D not a multiple of 16
    ([1500], 8, 2, 32, 900),  # a window, split
])
def test_paged_decode_attention_splits_long_sequences(dtype, seq_lens, hq, hkv, d, window):
    q, kc, vc, meta = _paged(seq_lens, hq, hkv, d, 16, dtype, num_blocks=256)
    ref = decode_attention(q, kc, vc, meta, 0.2, window)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):  # inline and split: the same result
            torch.set_num_threads(n)
            out = torch.ops.compress_cpu.paged_decode_attention(q, kc, vc, meta.decode_block_tables,
                                                                meta.decode_seq_lens, 0.2, window or 0)
            _close(out, ref, dtype, ulps=4)
    finally:
        torch.set_num_threads(threads)


def test_fused_paged_attention_writes_then_attends():
    """The model-facing entry point stores the new keys first (the query sees its own key)."""
    q, kc, vc, meta = _paged([9, 20], 4, 2, 16, 8, torch.float32, seed=5)
    k_new, v_new = torch.randn(2, 2, 16), torch.randn(2, 2, 16)
    meta.slot_mapping = torch.tensor([meta.decode_block_tables[0, 1].item() * 8 + 0,
                                      meta.decode_block_tables[1, 2].item() * 8 + 3])
    meta.decode_seq_lens = meta.decode_seq_lens + 1  # the new token extends each sequence (9 -> 10, 20 -> 21)
    kc2, vc2 = kc.clone(), vc.clone()
    out = fused_paged_attention(q, k_new, v_new, kc, vc, meta, 0.25)
    write_kv(kc2, vc2, k_new, v_new, meta.slot_mapping)
    torch.testing.assert_close(out, decode_attention(q, kc2, vc2, meta, 0.25), rtol=1e-5, atol=1e-5)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)


def test_select_ops_falls_back_to_torch():
    assert select_ops("cpu", torch.float32, enabled=False) is TORCH_OPS
    assert select_ops("cuda", torch.float32) is TORCH_OPS
    assert select_ops("cpu", torch.float16) is TORCH_OPS
    assert select_ops("cpu", torch.bfloat16) is FUSED_CPU_OPS


def test_a_failed_build_leaves_the_torch_path(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("COMPRESS_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    cpu_ext.load.cache_clear()
    try:
        assert cpu_ext.load() is False
        assert "fused CPU kernels unavailable" in caplog.text and "no C++ compiler" in caplog.text
        assert not any(tmp_path.rglob("*.so"))  # nothing half-built left in the cache
    finally:
        monkeypatch.undo()
        cpu_ext.load.cache_clear()
    assert cpu_ext.load() is True


@pytest.mark.parametrize("family", FAMILIES + MOE_FAMILIES)
def test_engine_greedy_is_the_same_on_both_paths(tmp_path, smol_tokenizer, family):
    """fp32: prefill, batched decode and chunking through the fused kernels and through torch's ops, same tokens."""
    hf = save_tiny(family, tmp_path, smol_tokenizer)
    ps = prompts(hf.config.vocab_size)
    outs = []
    for fused in (True, False):
        engine = Engine(EngineConfig(model=str(tmp_path), dtype="float32", kv_cache_memory=1 << 22, block_size=4,
                                     max_num_batched_tokens=16, fused_cpu_kernels=fused))
        assert engine.runner.ops is (FUSED_CPU_OPS if fused else TORCH_OPS)
        outs.append([o.token_ids for o in engine.generate(ps, SamplingParams(max_tokens=10, ignore_eos=True))])
    assert outs[0] == outs[1]


def _decode_logits(ckpt, dtype: str, fused: bool, prompt: list[int], forced: list[int]) -> torch.Tensor:
    """Logits of the prefill and of each forced decode step (teacher forcing: the same tokens on every path)."""
    runner = ModelRunner(ckpt, 32, 4, dtype, "cpu", "auto", 128, fused_cpu=fused, lm_head="fp")
    table = list(range(32))
    rows = [runner.forward([ForwardItem(prompt, 0, table, 1)])]
    for i, tok in enumerate(forced):
        rows.append(runner.forward([ForwardItem([tok], len(prompt) + i, table, 1)]))
    return torch.cat(rows)


@pytest.mark.parametrize("family", FAMILIES + MOE_FAMILIES)
def test_bf16_fused_path_is_as_close_to_fp32_as_torch(tmp_path, family):
    """In bf16 the two paths round differently (the fused attention keeps its probabilities in fp32), so tokens
    of a tiny random model may part at near-ties; the fused path must stay at least as close to fp32."""
    hf = save_tiny(family, tmp_path)
    ckpt = open_checkpoint(str(tmp_path))
    prompt, forced = prompts(hf.config.vocab_size, (21, 6), seed=3)
    ref = _decode_logits(ckpt, "float32", False, prompt, forced)
    err = {fused: (_decode_logits(ckpt, "bfloat16", fused, prompt, forced) - ref).abs().max().item()
           for fused in (True, False)}
    assert err[True] <= 1.25 * err[False] + 1e-3, err


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,k,n,pad", [(1, 64, 96, 0), (3, 577, 50, 63), (5, 40, 1031, 24)])
def test_int8_linear(dtype, m, k, n, pad):
    g = torch.Generator().manual_seed(6)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = torch.randint(-128, 128, (n, k + pad), dtype=torch.int8, generator=g)
    scale = torch.rand(n, generator=g) / 100
    ref = (x.float() @ (w[:, :k].float() * scale[:, None]).T).to(dtype)
    _close(torch.ops.compress_cpu.int8_linear(x, w, scale), ref, dtype)


@pytest.mark.parametrize("rows", [1, 3, 9])
def test_fused_int8_kernel_matches_the_aten_one(rows):
    """An int8 per-channel QuantLinear (asymmetric: with the zero-point correction) through both kernels."""
    from compress.format import quant
    from compress.format.qlinear import QuantLinear
    from compress.format.quant import Scheme
    from runtime.kernels.qmatmul import prepare_linear

    g = torch.Generator().manual_seed(7)
    w = torch.randn(70, 150, generator=g)
    ql = QuantLinear.from_quantized(quant.quantize_weight(w, Scheme(bits=8, group_size=-1, sym=False)))
    x = torch.randn(rows, 150, generator=g)
    ref = ql(x)
    aten = prepare_linear(ql, "packed", torch.float32, fused=False)(x)
    torch.testing.assert_close(aten, ref, rtol=2e-2, atol=0.1)  # aten's kernel runs bf16 activations
    fused = prepare_linear(ql, "packed", torch.float32, fused=True)(x)
    torch.testing.assert_close(fused, ref, rtol=1e-5, atol=1e-4)  # fp32 throughout: accumulation order only
