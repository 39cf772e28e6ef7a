"""The torch paged-attention path equals dense causal attention over each sequence's full K/V (or the
last ``window`` positions of it, with a sliding window; with scores soft-capped, Gemma 2), and the fused CPU decode
kernel equals the torch path with soft-capping too."""
import math

import pytest
import torch

from runtime.kernels.attention import AttentionMetadata, paged_attention

HEADS = [(4, 4), (4, 2), (8, 2), (4, 1)]  # GQA ratios 1, 2, 4 and MQA
BS = 4


def dense_reference(q, k, v, scale, window=None, softcap=None):
    """q: [n, Hq, D] (the last n positions), k/v: [L, Hkv, D] -> [n, Hq, D], explicit softmax in fp64; ``softcap``:
    scores s -> tanh(s / softcap) * softcap before the mask."""
    n, hq, _ = q.shape
    L, hkv, _ = k.shape
    k = k.double().repeat_interleave(hq // hkv, dim=1)
    v = v.double().repeat_interleave(hq // hkv, dim=1)
    s = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    q_pos = torch.arange(L - n, L)[:, None]
    s = s.masked_fill(torch.arange(L)[None, :] > q_pos, float("-inf"))
    if window is not None:  # key j visible to position i when i - window < j (transformers' sliding_window_overlay)
        s = s.masked_fill(torch.arange(L)[None, :] <= q_pos - window, float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v)


def build(cases, hq, hkv, d, gen):
    """cases: [(context_len, new_len, group)] -> inputs, metadata, pools, and the dense K/V per case."""
    need = [math.ceil((c + n) / BS) for c, n, _ in cases]
    num_blocks = sum(need) + 2
    k_cache = torch.randn(num_blocks, BS, hkv, d, generator=gen)
    v_cache = torch.randn(num_blocks, BS, hkv, d, generator=gen)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, dense, qs, ks, vs, slots = [], [], [], [], [], []
    for (ctx, n, _), nb in zip(cases, need):
        table = [perm.pop() for _ in range(nb)]
        tables.append(table)
        kk = torch.randn(ctx + n, hkv, d, generator=gen)
        vv = torch.randn(ctx + n, hkv, d, generator=gen)
        pos_slots = [table[p // BS] * BS + p % BS for p in range(ctx + n)]
        k_cache.view(-1, hkv, d)[pos_slots[:ctx]] = kk[:ctx]  # cached context
        v_cache.view(-1, hkv, d)[pos_slots[:ctx]] = vv[:ctx]
        dense.append((kk, vv))
        qs.append(torch.randn(n, hq, d, generator=gen))
        ks.append(kk[ctx:])
        vs.append(vv[ctx:])
        slots += pos_slots[ctx:]
    pre = [i for i, c in enumerate(cases) if c[2] == "prefill"]
    dec = [i for i, c in enumerate(cases) if c[2] == "decode"]
    order = pre + dec
    width = max(need)

    def table_tensor(idx):
        t = torch.zeros(len(idx), width, dtype=torch.int32)
        for r, i in enumerate(idx):
            t[r, :len(tables[i])] = torch.tensor(tables[i])
        return t

    def cu(idx):
        return torch.tensor([0] + list(torch.tensor([cases[i][1] for i in idx]).cumsum(0).tolist()), dtype=torch.int32)

    starts = [0]
    for c in cases:
        starts.append(starts[-1] + c[1])
    slot_order = sum((slots[starts[i]:starts[i + 1]] for i in order), [])
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slot_order, dtype=torch.long),
        num_prefill_tokens=sum(cases[i][1] for i in pre),
        prefill_cu_seqlens_q=cu(pre),
        prefill_seq_lens=torch.tensor([cases[i][0] + cases[i][1] for i in pre], dtype=torch.int32),
        prefill_block_tables=table_tensor(pre),
        prefill_q_lens=[cases[i][1] for i in pre], prefill_ctx_lens=[cases[i][0] for i in pre],
        decode_q_lens=[cases[i][1] for i in dec], decode_cu_seqlens_q=cu(dec),
        decode_seq_lens=torch.tensor([cases[i][0] + cases[i][1] for i in dec], dtype=torch.int32),
        decode_block_tables=table_tensor(dec),
        max_decode_seq_len=max((cases[i][0] + cases[i][1] for i in dec), default=0),
    )
    cat = lambda xs: torch.cat([xs[i] for i in order])  # noqa: E731
    return cat(qs), cat(ks), cat(vs), meta, k_cache, v_cache, [(i, dense[i], qs[i]) for i in order]


CASES = {
    "prefill_only": [(0, 7, "prefill"), (0, 1, "prefill"), (0, 12, "prefill")],
    "chunk_after_context": [(5, 6, "prefill"), (8, 8, "prefill"), (0, 3, "prefill")],
    "decode_only": [(6, 1, "decode"), (15, 1, "decode"), (1, 1, "decode"), (8, 1, "decode")],
    "verify_ragged": [(9, 3, "decode"), (4, 1, "decode"), (13, 5, "decode")],
    "mixed": [(0, 9, "prefill"), (7, 4, "prefill"), (11, 1, "decode"), (3, 2, "decode"), (16, 1, "decode")],
}


@pytest.mark.parametrize("window", [None, 5, 1])  # full attention, a window shorter than most sequences, itself only
@pytest.mark.parametrize("hq,hkv", HEADS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_paged_equals_dense(case, hq, hkv, window):
    gen = torch.Generator().manual_seed(sum(map(ord, case)) + hq * 10 + hkv)
    d = 16
    scale = d ** -0.5
    q, k, v, meta, k_cache, v_cache, per_seq = build(CASES[case], hq, hkv, d, gen)
    out = paged_attention(q, k, v, k_cache, v_cache, meta, scale, window)
    start = 0
    for _, (kk, vv), qq in per_seq:
        n = qq.shape[0]
        ref = dense_reference(qq, kk, vv, scale, window)
        torch.testing.assert_close(out[start:start + n].double(), ref, atol=1e-5, rtol=1e-5)
        start += n
    assert start == out.shape[0]


def test_new_kv_lands_in_its_slots():
    gen = torch.Generator().manual_seed(0)
    q, k, v, meta, k_cache, v_cache, _ = build(CASES["mixed"], 4, 2, 8, gen)
    paged_attention(q, k, v, k_cache, v_cache, meta, 1.0)
    torch.testing.assert_close(k_cache.view(-1, 2, 8)[meta.slot_mapping], k)
    torch.testing.assert_close(v_cache.view(-1, 2, 8)[meta.slot_mapping], v)



def test_layers_with_different_windows_share_one_forward_metadata():
    """Per-forward masks are cached in the metadata per window: a full layer after a sliding one (Qwen2's
    max_window_layers) must not reuse the sliding layer's mask, nor the reverse."""
    gen = torch.Generator().manual_seed(1)
    q, k, v, meta, k_cache, v_cache, per_seq = build(CASES["mixed"], 4, 2, 16, gen)
    for window in (3, None, 3):
        out = paged_attention(q, k, v, k_cache, v_cache, meta, 0.25, window)
        start = 0
        for _, (kk, vv), qq in per_seq:
            n = qq.shape[0]
            torch.testing.assert_close(out[start:start + n].double(), dense_reference(qq, kk, vv, 0.25, window),
                                       atol=1e-5, rtol=1e-5)
            start += n


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("hq,hkv", [(4, 2), (4, 1)])
@pytest.mark.parametrize("case", sorted(CASES))
def test_softcapped_paged_equals_dense(case, hq, hkv, window):
    """A cap of 0.8 on scores of spread ~2 changes every softmax: the capped path is the one taken, in prefill
    (fresh and after context), decode and verification."""
    gen = torch.Generator().manual_seed(sum(map(ord, case)) + hkv)
    q, k, v, meta, k_cache, v_cache, per_seq = build(CASES[case], hq, hkv, 16, gen)
    out = paged_attention(q, k, v, k_cache, v_cache, meta, 0.5, window, softcap=0.8)
    uncapped = paged_attention(q, k, v, k_cache.clone(), v_cache.clone(), meta, 0.5, window)
    assert not torch.allclose(out, uncapped, atol=1e-3)
    start = 0
    for _, (kk, vv), qq in per_seq:
        n = qq.shape[0]
        ref = dense_reference(qq, kk, vv, 0.5, window, softcap=0.8)
        torch.testing.assert_close(out[start:start + n].double(), ref, atol=1e-5, rtol=1e-5)
        start += n


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("case", ["decode_only", "mixed", "verify_ragged"])
def test_fused_cpu_softcap_equals_torch_path(case, window, dtype):
    """runtime/kernels/cpu/decode_attention.cpp caps scores as the torch path does (plain decoding runs there;
    prefill and verification stay on the torch path inside fused_paged_attention)."""
    from runtime.kernels import cpu_ext
    from runtime.kernels.attention import fused_paged_attention

    if not cpu_ext.load():
        pytest.skip("the fused CPU kernels did not build here")
    gen = torch.Generator().manual_seed(len(case) + (window or 0))
    q, k, v, meta, k_cache, v_cache, _ = build(CASES[case], 6, 2, 24, gen)
    q, k, v, k_cache, v_cache = (x.to(dtype) for x in (q, k, v, k_cache, v_cache))
    ref = paged_attention(q, k, v, k_cache.clone(), v_cache.clone(), meta, 0.4, window, softcap=1.2)
    out = fused_paged_attention(q, k, v, k_cache, v_cache, meta, 0.4, window, softcap=1.2)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
