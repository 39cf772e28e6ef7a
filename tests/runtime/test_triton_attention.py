"""Triton paged attention (prefill and flash-decoding) against a plain torch reference.

On CPU the kernels run under TRITON_INTERPRET=1 (tests/conftest.py sets it before Triton loads).
The reference below gathers each sequence's keys through its block table and applies a causal
softmax the textbook way; the cache holds random values everywhere, so a kernel reading a wrong
block, slot or head gets a wrong answer.
"""
import math
import os

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HEADS = [(4, 4), (4, 2), (8, 2), (4, 1)]  # (query heads, KV heads): GQA ratios 1, 2, 4 and MQA


@pytest.fixture(scope="module")
def ta():
    if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.fail("Triton kernels need TRITON_INTERPRET=1 without CUDA; tests/conftest.py sets it before Triton loads")
    import runtime.kernels.triton_attention as ta
    return ta


def ref_attention(q, k_cache, v_cache, block_table, seq_len, scale, window=None, softcap=None):
    """q: [n, Hq, D], the last n of seq_len positions -> [n, Hq, D] (fp32 math); ``window``: each query sees
    only its last ``window`` positions; ``softcap``: scores s -> tanh(s / softcap) * softcap."""
    n, hq, _ = q.shape
    block_size, hkv = k_cache.shape[1], k_cache.shape[2]
    pos = torch.arange(seq_len, device=q.device)
    blocks = block_table[pos // block_size].long()
    k = k_cache[blocks, pos % block_size].float()  # [seq_len, Hkv, D]
    v = v_cache[blocks, pos % block_size].float()
    k = k.repeat_interleave(hq // hkv, dim=1)  # query head h reads KV head h // group
    v = v.repeat_interleave(hq // hkv, dim=1)
    s = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    q_pos = torch.arange(seq_len - n, seq_len, device=q.device)
    s = s.masked_fill(pos[None, None, :] > q_pos[None, :, None], float("-inf"))
    if window is not None:
        s = s.masked_fill(pos[None, None, :] <= q_pos[None, :, None] - window, float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v)


def paged_setup(seq_lens, block_size, hkv, d, dtype, gen):
    """A random pool with spare blocks and a shuffled block table per sequence."""
    need = [math.ceil(s / block_size) for s in seq_lens]
    num_blocks = sum(need) + 3
    k_cache = torch.randn(num_blocks, block_size, hkv, d, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, hkv, d, generator=gen).to(dtype)
    perm = torch.randperm(num_blocks, generator=gen)
    table = torch.zeros(len(seq_lens), max(need), dtype=torch.int32)
    used = 0
    for i, n in enumerate(need):
        table[i, :n] = perm[used:used + n]
        used += n
    return k_cache.to(DEVICE), v_cache.to(DEVICE), table.to(DEVICE)


@pytest.mark.parametrize("hq,hkv", HEADS)
@pytest.mark.parametrize("ctx_new,block_size", [
    ([(0, 5), (7, 9), (16, 1), (3, 21)], 4),  # prefix-cached contexts, lengths ending mid-block
    ([(0, 37), (20, 13)], 16),  # tiles that straddle blocks
    ([(0, 80), (50, 30)], 16),  # several query tiles and key tiles: the online softmax rescales
    ([(0, 1)], 16),  # a single token
])
def test_prefill_matches_reference(ta, hq, hkv, ctx_new, block_size):
    gen = torch.Generator().manual_seed(hq * 10 + hkv + block_size)
    d = 16
    seq_lens = [c + n for c, n in ctx_new]
    k_cache, v_cache, table = paged_setup(seq_lens, block_size, hkv, d, torch.float32, gen)
    q_lens = [n for _, n in ctx_new]
    q = torch.randn(sum(q_lens), hq, d, generator=gen).to(DEVICE)
    cu = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(torch.int32).to(DEVICE)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    scale = d ** -0.5
    out = ta.triton_prefill_attention(q, k_cache, v_cache, table, cu, sl, scale)
    for b, (start, end) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        ref = ref_attention(q[start:end], k_cache, v_cache, table[b], seq_lens[b], scale)
        torch.testing.assert_close(out[start:end], ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("hq,hkv", HEADS)
@pytest.mark.parametrize("partition_size", [32, 256])  # several partitions per sequence, and one
def test_decode_matches_reference(ta, hq, hkv, partition_size):
    gen = torch.Generator().manual_seed(hq * 7 + hkv + partition_size)
    d, block_size = 16, 8
    seq_lens = [1, 5, 33, 70, 64]
    k_cache, v_cache, table = paged_setup(seq_lens, block_size, hkv, d, torch.float32, gen)
    q = torch.randn(len(seq_lens), hq, d, generator=gen).to(DEVICE)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    out = ta.triton_decode_attention(q, k_cache, v_cache, table, sl, 0.3, partition_size=partition_size)
    for b, n in enumerate(seq_lens):
        ref = ref_attention(q[b:b + 1], k_cache, v_cache, table[b], n, 0.3)
        torch.testing.assert_close(out[b:b + 1], ref, rtol=1e-4, atol=1e-4)


def test_decode_equals_prefill_of_one_token(ta):
    """Decoding is the one-new-token case of prefill with a cached context: both kernels must agree."""
    gen = torch.Generator().manual_seed(3)
    seq_lens = [9, 40, 17]
    k_cache, v_cache, table = paged_setup(seq_lens, 4, 2, 16, torch.float32, gen)
    q = torch.randn(3, 4, 16, generator=gen).to(DEVICE)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    cu = torch.arange(4, dtype=torch.int32, device=DEVICE)
    dec = ta.triton_decode_attention(q, k_cache, v_cache, table, sl, partition_size=32)
    pre = ta.triton_prefill_attention(q, k_cache, v_cache, table, cu, sl)
    torch.testing.assert_close(dec, pre, rtol=1e-5, atol=1e-5)


def test_fp16_and_non_power_of_two_head_dim(ta):
    gen = torch.Generator().manual_seed(5)
    d, seq_lens, q_lens = 24, [13, 30], [13, 6]
    k_cache, v_cache, table = paged_setup(seq_lens, 8, 2, d, torch.float16, gen)
    q = torch.randn(sum(q_lens), 4, d, generator=gen).half().to(DEVICE)
    cu = torch.tensor([0, 13, 19], dtype=torch.int32, device=DEVICE)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    out = ta.triton_prefill_attention(q, k_cache, v_cache, table, cu, sl)
    assert out.dtype == torch.float16
    for b in range(2):
        ref = ref_attention(q[cu[b]:cu[b + 1]], k_cache, v_cache, table[b], seq_lens[b], d ** -0.5)
        torch.testing.assert_close(out[cu[b]:cu[b + 1]].float(), ref, rtol=2e-2, atol=2e-2)
    qd = q[[12, 18]]
    dec = ta.triton_decode_attention(qd, k_cache, v_cache, table, sl, partition_size=32)
    for b in range(2):
        ref = ref_attention(qd[b:b + 1], k_cache, v_cache, table[b], seq_lens[b], d ** -0.5)
        torch.testing.assert_close(dec[b:b + 1].float(), ref, rtol=2e-2, atol=2e-2)


def test_rejects_heads_not_multiple_of_kv_heads(ta):
    k = torch.zeros(2, 4, 3, 8, device=DEVICE)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        ta.triton_decode_attention(torch.zeros(1, 4, 8, device=DEVICE), k, k, torch.zeros(1, 1, dtype=torch.int32,
                                   device=DEVICE), torch.ones(1, dtype=torch.int32, device=DEVICE))


@pytest.mark.parametrize("window", [1, 7, 40, 100])  # itself only, inside a key tile, across tiles, no effect
def test_sliding_window_prefill_and_decode(ta, window):
    gen = torch.Generator().manual_seed(window)
    d, block_size = 16, 8
    ctx_new = [(0, 80), (50, 30), (3, 2), (90, 1)]
    seq_lens = [c + n for c, n in ctx_new]
    k_cache, v_cache, table = paged_setup(seq_lens, block_size, 2, d, torch.float32, gen)
    q_lens = [n for _, n in ctx_new]
    q = torch.randn(sum(q_lens), 4, d, generator=gen).to(DEVICE)
    cu = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(torch.int32).to(DEVICE)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    out = ta.triton_prefill_attention(q, k_cache, v_cache, table, cu, sl, 0.25, window=window)
    last = cu[1:].long() - 1  # each sequence's last query: decoding of one token
    dec = ta.triton_decode_attention(q[last], k_cache, v_cache, table, sl, 0.25, partition_size=32, window=window)
    for b, (start, end) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        ref = ref_attention(q[start:end], k_cache, v_cache, table[b], seq_lens[b], 0.25, window)
        torch.testing.assert_close(out[start:end], ref, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(dec[b], ref[-1], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("softcap", [0.7, 30.0])  # changes every softmax; a cap far above the scores
@pytest.mark.parametrize("window", [None, 7])
def test_softcap_prefill_and_decode(ta, softcap, window):
    """Gemma 2's attention soft-capping in both kernels (scores in log2 units inside: the same map), with
    contexts, GQA, a window, and several decode partitions; fp32 against the reference, fp16 within rounding (the
    interpreter does not run bf16)."""
    gen = torch.Generator().manual_seed(int(softcap * 10) + (window or 0))
    d, block_size, hq, hkv = 16, 8, 4, 2
    ctx_new = [(0, 37), (50, 30), (3, 2), (90, 1)]
    seq_lens = [c + n for c, n in ctx_new]
    k_cache, v_cache, table = paged_setup(seq_lens, block_size, hkv, d, torch.float32, gen)
    q_lens = [n for _, n in ctx_new]
    q = (torch.randn(sum(q_lens), hq, d, generator=gen) * 2).to(DEVICE)  # scores of spread ~2 at scale 0.25
    cu = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(torch.int32).to(DEVICE)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    last = cu[1:].long() - 1
    for dtype, tol in ((torch.float32, 1e-4), (torch.float16, 1e-2)):
        qd, kd, vd = q.to(dtype), k_cache.to(dtype), v_cache.to(dtype)
        pre = ta.triton_prefill_attention(qd, kd, vd, table, cu, sl, 0.25, window=window, softcap=softcap)
        dec = ta.triton_decode_attention(qd[last], kd, vd, table, sl, 0.25, partition_size=32, window=window,
                                         softcap=softcap)
        for b, (start, end) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
            ref = ref_attention(qd[start:end], kd, vd, table[b], seq_lens[b], 0.25, window, softcap)
            torch.testing.assert_close(pre[start:end].float(), ref, rtol=tol, atol=tol)
            torch.testing.assert_close(dec[b].float(), ref[-1], rtol=tol, atol=tol)
    if softcap < 1:  # the cap is applied, not skipped
        plain = ta.triton_decode_attention(q[last], k_cache, v_cache, table, sl, 0.25, partition_size=32, window=window)
        assert not torch.allclose(plain, dec.float(), atol=1e-2)


def make_meta(prefill, decode, block_size, num_blocks, gen):
    """AttentionMetadata for prefill chunks ``[(ctx, n)]`` then decode sequences ``[(ctx, q)]``, with shuffled
    block tables, plus the slot of every new token."""
    from runtime.kernels.attention import AttentionMetadata

    perm = torch.randperm(num_blocks, generator=gen).tolist()

    def tables(group):
        need = [math.ceil((c + n) / block_size) for c, n in group]
        t = torch.zeros(len(group), max(need, default=1), dtype=torch.int32)
        for i, k in enumerate(need):
            t[i, :k] = torch.tensor([perm.pop() for _ in range(k)])
        return t

    pt, dt = tables(prefill), tables(decode)
    slots = []
    for group, t in ((prefill, pt), (decode, dt)):
        for i, (c, n) in enumerate(group):
            pos = torch.arange(c, c + n)
            slots.append(t[i, pos // block_size].long() * block_size + pos % block_size)
    cu = lambda lens: torch.tensor([0] + lens).cumsum(0).to(torch.int32).to(DEVICE)  # noqa: E731
    i32 = lambda xs: torch.tensor(xs, dtype=torch.int32, device=DEVICE)  # noqa: E731
    return AttentionMetadata(
        slot_mapping=torch.cat(slots).to(DEVICE), num_prefill_tokens=sum(n for _, n in prefill),
        prefill_cu_seqlens_q=cu([n for _, n in prefill]), prefill_seq_lens=i32([c + n for c, n in prefill]),
        prefill_block_tables=pt.to(DEVICE), prefill_q_lens=[n for _, n in prefill], prefill_ctx_lens=[c for c, _ in prefill],
        decode_q_lens=[n for _, n in decode], decode_cu_seqlens_q=cu([n for _, n in decode]),
        decode_seq_lens=i32([c + n for c, n in decode]), decode_block_tables=dt.to(DEVICE),
        max_decode_seq_len=max((c + n for c, n in decode), default=0))


@pytest.mark.parametrize("softcap", [None, 1.5])
@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("hq,hkv", [(4, 2), (4, 1)])
@pytest.mark.parametrize("prefill,decode", [
    ([(0, 7), (12, 5)], []),  # prefill only: a fresh prompt and a chunk after a cached prefix
    ([], [(20, 1), (9, 1), (33, 1)]),  # plain decoding: flash-decoding
    ([(0, 9)], [(20, 3), (9, 1), (33, 5)]),  # mixed, with speculative verification (several queries)
])
def test_paged_attention_matches_engine_reference(ta, hq, hkv, prefill, decode, window, softcap):
    """The engine's CUDA path (attention.triton_paged_attention, on these kernels) against its torch path."""
    from runtime.kernels.attention import paged_attention, triton_paged_attention

    gen = torch.Generator().manual_seed(len(prefill) * 10 + len(decode) + hkv)
    d, block_size, num_blocks = 16, 4, 40
    meta = make_meta(prefill, decode, block_size, num_blocks, gen)
    t = sum(n for _, n in prefill + decode)
    q = torch.randn(t, hq, d, generator=gen).to(DEVICE)
    k = torch.randn(t, hkv, d, generator=gen).to(DEVICE)
    v = torch.randn(t, hkv, d, generator=gen).to(DEVICE)
    kc = torch.randn(num_blocks, block_size, hkv, d, generator=gen).to(DEVICE)
    vc = torch.randn(num_blocks, block_size, hkv, d, generator=gen).to(DEVICE)
    kc2, vc2 = kc.clone(), vc.clone()
    ref = paged_attention(q, k, v, kc, vc, meta, 0.25, window, softcap=softcap)
    out = triton_paged_attention(q, k, v, kc2, vc2, meta, 0.25, window, softcap=softcap)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)



# --- 8-bit KV cache (runtime/kernels/kv_quant.py) -----------------------------------------------------------------
def quantized_setup(name, seq_lens, block_size, hkv, d, gen):
    """A random pool stored as 8-bit codes + fp16 scales, and the same pool dequantized to fp32."""
    from runtime.kernels.kv_quant import dequantize_kv, kv_format, quantize_kv

    k_fp, v_fp, table = paged_setup(seq_lens, block_size, hkv, d, torch.float32, gen)
    out = []
    for cache in (k_fp, v_fp):
        codes, scales = quantize_kv(cache.view(-1, hkv, d), kv_format(name))
        codes, scales = codes.view(cache.shape), scales.view(cache.shape[:3])
        out.append((codes, scales, dequantize_kv(codes, scales, torch.float32)))
    return out[0], out[1], table


@pytest.mark.parametrize("name", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize("hq,hkv", [(4, 2), (4, 1)])
@pytest.mark.parametrize("window", [None, 20])
def test_8bit_cache_decode_and_prefill(ta, name, hq, hkv, window):
    """On codes with scales, both kernels equal the reference on the dequantized cache (fp32, accumulation order
    only); scales are read per token and KV head through the block table, so a wrong index shows."""
    gen = torch.Generator().manual_seed(hq + hkv + (window or 0))
    d, block_size, seq_lens = 32, 8, [1, 33, 70, 12]
    (kc, ks, kd), (vc, vs, vd), table = quantized_setup(name, seq_lens, block_size, hkv, d, gen)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    q = torch.randn(len(seq_lens), hq, d, generator=gen).to(DEVICE)
    dec = ta.triton_decode_attention(q, kc, vc, table, sl, 0.3, partition_size=32, window=window, k_scale=ks,
                                     v_scale=vs)
    q_lens = [1, 5, 30, 12]
    qp = torch.randn(sum(q_lens), hq, d, generator=gen).to(DEVICE)
    cu = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(torch.int32).to(DEVICE)
    pre = ta.triton_prefill_attention(qp, kc, vc, table, cu, sl, 0.3, window=window, k_scale=ks, v_scale=vs)
    for b, n in enumerate(seq_lens):
        ref = ref_attention(q[b:b + 1], kd, vd, table[b], n, 0.3, window)
        torch.testing.assert_close(dec[b:b + 1], ref, rtol=1e-4, atol=1e-4)
        ref = ref_attention(qp[cu[b]:cu[b + 1]], kd, vd, table[b], n, 0.3, window)
        torch.testing.assert_close(pre[cu[b]:cu[b + 1]], ref, rtol=1e-4, atol=1e-4)


def test_8bit_cache_needs_its_scales(ta):
    gen = torch.Generator().manual_seed(0)
    (kc, ks, _), (vc, vs, _), table = quantized_setup("int8", [5], 4, 1, 16, gen)
    q, sl = torch.zeros(1, 2, 16, device=DEVICE), torch.tensor([5], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="needs k_scale and v_scale"):
        ta.triton_decode_attention(q, kc, vc, table, sl)
    with pytest.raises(ValueError, match=r"must be \[num_blocks, block_size, num_kv_heads\]"):
        ta.triton_decode_attention(q, kc, vc, table, sl, k_scale=ks[:, :2], v_scale=vs[:, :2])


@pytest.mark.parametrize("name", ["int8", "fp8_e4m3"])
def test_paged_attention_on_8bit_cache_matches_engine_reference(ta, name):
    """The engine's CUDA entry point on an 8-bit pool: the same codes and scales written, the same outputs as the
    torch path (prefill, a chunk after context, decode and verification in one forward)."""
    from runtime.kernels.attention import paged_attention, triton_paged_attention
    from runtime.kernels.kv_quant import kv_format, quantize_kv

    gen = torch.Generator().manual_seed(7)
    hq, hkv, d, block_size, num_blocks = 4, 2, 16, 4, 40
    meta = make_meta([(0, 9), (6, 4)], [(20, 3), (9, 1)], block_size, num_blocks, gen)
    t = 9 + 4 + 3 + 1
    q, k, v = (torch.randn(t, h, d, generator=gen).to(DEVICE) for h in (hq, hkv, hkv))
    pools = []
    for _ in range(2):
        codes, scales = quantize_kv(torch.randn(num_blocks * block_size, hkv, d, generator=gen), kv_format(name))
        pools += [codes.view(num_blocks, block_size, hkv, d).to(DEVICE),
                  scales.view(num_blocks, block_size, hkv).to(DEVICE)]
    kc, ks, vc, vs = pools
    copies = [x.clone() for x in pools]
    ref = paged_attention(q, k, v, kc, vc, meta, 0.25, None, ks, vs)
    out = triton_paged_attention(q, k, v, copies[0], copies[2], meta, 0.25, None, copies[1], copies[3])
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    for a, b in zip(pools, copies):
        assert torch.equal(a.view(torch.uint8) if a.dtype.itemsize == 1 else a,
                           b.view(torch.uint8) if b.dtype.itemsize == 1 else b)
