"""Paged attention in Triton: FlashAttention-style varlen causal prefill and flash-decoding.

Both read keys and values from the paged KV pool ``[num_blocks, block_size, num_kv_heads, head_dim]``
through a per-sequence block table, so prefix-cached context and freshly stored tokens look alike
(the caller stores the new tokens' K/V first). Scores live only as ``[BLOCK_M, BLOCK_N]`` tiles with
an online softmax (Dao et al., FlashAttention-2); the full score matrix is never formed.

- prefill: one program per (query tile, sequence, query head). Query ``i`` of sequence ``b`` sits at
  position ``context_len_b + i`` and sees keys ``0..context_len_b + i`` (causal with a cached prefix).
  It also serves speculative verification (several new tokens after a long context).
- decode: flash-decoding (Dao et al., 2023). Stage 1 splits each sequence's keys into partitions of
  ``partition_size``; one program per (sequence, KV head, partition) handles every query head that
  shares the KV head (GQA/MQA) in one ``tl.dot``, writing a partial max, sum and normalized output.
  Stage 2 rescales and combines the partials per (sequence, query head).
Softmax runs in base 2 (``exp2``) with ``log2(e)`` folded into the scale; accumulation is fp32.
An 8-bit cache (runtime/kernels/kv_quant.py; ``QUANT``) holds int8/fp8 codes with one fp16 scale per token and
KV head in ``k_scale, v_scale: [num_blocks, block_size, num_kv_heads]``: codes convert exactly to the query's
dtype for ``tl.dot``, each key's scale multiplies its column of scores and each value's scale its column of
probabilities (after the softmax sum), so the dequantized tiles are never formed.
A sliding ``window`` (runtime/kernels/attention.py) bounds keys from below too: query position ``i``
sees keys ``i - window < j <= i``; key tiles wholly before a tile's window are skipped (``NO_WINDOW``,
a bound past any position, stands for full attention).
A ``softcap`` (Gemma 2; ``SOFTCAP``) bounds each score to ``tanh(s / softcap) * softcap`` before the mask; the
kernels apply it in log2 units (``cap = softcap * log2(e)``, the same map) with tanh spelled through ``exp2``.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

LOG2E = 1.4426950408889634
NEG_BIG = tl.constexpr(-1.0e30)  # finite "minus infinity" for running maxima: exp2(NEG_BIG - NEG_BIG) is 1, not NaN
NO_WINDOW = 1 << 30  # a window no sequence reaches: full causal attention
TWO_LOG2E = tl.constexpr(2 * LOG2E)


@triton.jit
def _softcap(s, cap):
    """``cap * tanh(s / cap)``, tanh(y) as 1 - 2 / (e^(2y) + 1); 2y * log2(e) is clamped at 64, where the
    quotient is already below fp32's resolution of 1 (so e^(2y) never overflows)."""
    return cap * (1.0 - 2.0 / (tl.exp2(tl.minimum(s * (TWO_LOG2E / cap), 64.0)) + 1.0))


@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr, cu_q_ptr, seq_lens_ptr, out_ptr,
    qk_scale, softcap, block_size, head_dim, window,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_sb, stride_ss,
    stride_btb, stride_ot, stride_oh,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr, QUANT: tl.constexpr, SOFTCAP: tl.constexpr,
):
    pid_m, b, h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q_start = tl.load(cu_q_ptr + b)
    q_len = tl.load(cu_q_ptr + b + 1) - q_start
    if pid_m * BLOCK_M >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + b)
    ctx = seq_len - q_len  # tokens already in the cache before this step's queries
    kvh = h // GROUP
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # query index inside the sequence
    offs_d = tl.arange(0, BLOCK_D)
    m_ok, d_ok = offs_m < q_len, offs_d < head_dim
    q = tl.load(q_ptr + (q_start + offs_m)[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
                mask=m_ok[:, None] & d_ok[None, :], other=0.0)  # [BM, BD]
    m_i = tl.full((BLOCK_M,), NEG_BIG, dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    # the last query of this tile sees keys up to ctx + its index; later tiles of keys are all masked
    end = tl.minimum(seq_len, ctx + (pid_m + 1) * BLOCK_M)
    # the first query of this tile sees keys after ctx + its index - window; earlier tiles of keys are all masked
    lo = tl.maximum(ctx + pid_m * BLOCK_M - window + 1, 0) // BLOCK_N * BLOCK_N
    for n0 in range(lo, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < seq_len
        # logical key position -> (physical block, slot) through the block table
        blk = tl.load(bt_ptr + b * stride_btb + offs_n // block_size, mask=n_ok, other=0).to(tl.int64)
        slot = offs_n % block_size
        kv_ok = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + blk[:, None] * stride_kb + slot[:, None] * stride_ks + kvh * stride_kh + offs_d[None, :],
                    mask=kv_ok, other=0.0)  # [BN, BD]
        if QUANT:  # codes are exact in q's dtype; each key's scale multiplies its column of scores
            k = k.to(q.dtype)
            k_s = tl.load(ks_ptr + blk * stride_sb + slot * stride_ss + kvh, mask=n_ok, other=0.0).to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BM, BN], log2 units
        if QUANT:
            s = s * k_s[None, :]
        if SOFTCAP:
            s = _softcap(s, softcap)
        visible = ((ctx + offs_m)[:, None] >= offs_n[None, :]) & n_ok[None, :]
        visible = visible & (offs_n[None, :] > (ctx + offs_m)[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + blk[:, None] * stride_vb + slot[:, None] * stride_vs + kvh * stride_vh + offs_d[None, :],
                    mask=kv_ok, other=0.0)  # [BN, BD]
        if QUANT:  # each value's scale multiplies its column of probabilities (the sum above is unscaled)
            v = v.to(q.dtype)
            v_s = tl.load(vs_ptr + blk * stride_sb + slot * stride_ss + kvh, mask=n_ok, other=0.0).to(tl.float32)
            p = p * v_s[None, :]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + (q_start + offs_m)[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])


@triton.jit
def _decode_partition_kernel(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr, seq_lens_ptr, part_out_ptr, part_m_ptr, part_l_ptr,
    qk_scale, softcap, block_size, head_dim, num_partitions, window,
    stride_qb, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_sb, stride_ss,
    stride_btb,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    PARTITION: tl.constexpr, DOT_PRECISION: tl.constexpr, QUANT: tl.constexpr, SOFTCAP: tl.constexpr,
):
    b, kvh, part = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    offs_g = tl.arange(0, BLOCK_G)  # query heads sharing this KV head
    offs_d = tl.arange(0, BLOCK_D)
    g_ok, d_ok = offs_g < GROUP, offs_d < head_dim
    heads = kvh * GROUP + offs_g
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0)  # [BG, BD]
    m_i = tl.full((BLOCK_G,), NEG_BIG, dtype=tl.float32)
    l_i = tl.zeros((BLOCK_G,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_D), dtype=tl.float32)
    # keys of this partition inside the window of the query (position seq_len - 1): empty when there are none
    start = tl.maximum(part * PARTITION, seq_len - window)
    end = tl.minimum(seq_len, part * PARTITION + PARTITION)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < end
        blk = tl.load(bt_ptr + b * stride_btb + offs_n // block_size, mask=n_ok, other=0).to(tl.int64)
        slot = offs_n % block_size
        kv_ok = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + blk[:, None] * stride_kb + slot[:, None] * stride_ks + kvh * stride_kh + offs_d[None, :],
                    mask=kv_ok, other=0.0)
        if QUANT:
            k = k.to(q.dtype)
            k_s = tl.load(ks_ptr + blk * stride_sb + slot * stride_ss + kvh, mask=n_ok, other=0.0).to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BG, BN]
        if QUANT:
            s = s * k_s[None, :]
        if SOFTCAP:
            s = _softcap(s, softcap)
        s = tl.where(n_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + blk[:, None] * stride_vb + slot[:, None] * stride_vs + kvh * stride_vh + offs_d[None, :],
                    mask=kv_ok, other=0.0)
        if QUANT:  # each value's scale multiplies its column of probabilities (the sum above is unscaled)
            v = v.to(q.dtype)
            v_s = tl.load(vs_ptr + blk * stride_sb + slot * stride_ss + kvh, mask=n_ok, other=0.0).to(tl.float32)
            p = p * v_s[None, :]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    # partials: [B, Hq, P] for max and sum, [B, Hq, P, BD] for outputs (contiguous fp32)
    row = (b * (tl.num_programs(1) * GROUP) + heads) * num_partitions + part
    tl.store(part_m_ptr + row, m_i, mask=g_ok)
    tl.store(part_l_ptr + row, l_i, mask=g_ok)
    tl.store(part_out_ptr + row[:, None] * BLOCK_D + offs_d[None, :], acc, mask=g_ok[:, None])


@triton.jit
def _decode_reduce_kernel(
    part_out_ptr, part_m_ptr, part_l_ptr, out_ptr, head_dim, num_partitions, stride_ob, stride_oh,
    BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr,
):
    b, h = tl.program_id(0), tl.program_id(1)
    offs_p = tl.arange(0, BLOCK_P)
    offs_d = tl.arange(0, BLOCK_D)
    p_ok = offs_p < num_partitions
    row = (b * tl.num_programs(1) + h) * num_partitions + offs_p
    m = tl.load(part_m_ptr + row, mask=p_ok, other=NEG_BIG)
    l = tl.load(part_l_ptr + row, mask=p_ok, other=0.0)
    o = tl.load(part_out_ptr + row[:, None] * BLOCK_D + offs_d[None, :], mask=p_ok[:, None], other=0.0)  # [BP, BD]
    w = l * tl.exp2(m - tl.max(m, axis=0))  # each partition's softmax mass on a common scale
    out = tl.sum(o * w[:, None], axis=0) / tl.maximum(tl.sum(w, axis=0), 1e-30)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty), mask=offs_d < head_dim)


def prefill_tiles(max_query_len: int, head_dim: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N): 16 query rows (tl.dot's minimum) for short extends, 64 for real prompts."""
    return (16 if max_query_len <= 16 else 64), (64 if head_dim <= 128 else 32)


def _check_cache(q: Tensor, k_cache: Tensor, v_cache: Tensor) -> tuple[int, int, int]:
    """(num_kv_heads, group, head_dim) after checking shapes; the last dim must be contiguous."""
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache/v_cache must both be [num_blocks, block_size, num_kv_heads, head_dim] of one "
                         f"dtype, got {tuple(k_cache.shape)} {k_cache.dtype} and "
                         f"{tuple(v_cache.shape)} {v_cache.dtype}")
    hq, d = q.shape[-2], q.shape[-1]
    hkv = k_cache.shape[2]
    if k_cache.shape[3] != d or hq % hkv:
        raise ValueError(f"q has {hq} heads of dim {d}; the cache has {hkv} KV heads of dim {k_cache.shape[3]} "
                         "(query heads must be a multiple of KV heads)")
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    return hkv, hq // hkv, d


def _scales(k_cache: Tensor, k_scale: Tensor | None, v_scale: Tensor | None) -> tuple[Tensor, Tensor, int, int]:
    """(k scales, v scales, block stride, slot stride) for the kernels; the cache itself and zero strides when
    it holds the compute dtype (the kernels then never read them)."""
    coded = k_cache.dtype.itemsize == 1
    if coded != (k_scale is not None) or (k_scale is None) != (v_scale is None):
        raise ValueError(f"a {k_cache.dtype} cache needs k_scale and v_scale exactly when it holds 8-bit codes")
    if k_scale is None:
        return k_cache, k_cache, 0, 0
    if k_scale.shape != k_cache.shape[:3] or v_scale.shape != k_scale.shape or k_scale.stride() != v_scale.stride() \
            or k_scale.stride(2) != 1:
        raise ValueError(f"k_scale/v_scale must be [num_blocks, block_size, num_kv_heads] like the cache "
                         f"{tuple(k_cache.shape[:3])}, got {tuple(k_scale.shape)} and {tuple(v_scale.shape)}")
    return k_scale, v_scale, k_scale.stride(0), k_scale.stride(1)


def _window(window: int | None) -> int:
    if window is not None and window < 1:
        raise ValueError(f"window={window} must be >= 1, or None for full causal attention")
    return NO_WINDOW if window is None else min(window, NO_WINDOW)


def _cap(softcap: float | None) -> float:
    """The soft-cap in the kernels' log2 units (1.0, unread, without one)."""
    if softcap is not None and softcap <= 0:
        raise ValueError(f"softcap={softcap} must be > 0, or None for no soft-capping")
    return 1.0 if softcap is None else softcap * LOG2E


def _precision(t: Tensor) -> str:
    return "ieee" if t.dtype == torch.float32 else "tf32"


def triton_prefill_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor,
                             cu_seqlens_q: Tensor, seq_lens: Tensor, scale: float | None = None,
                             max_query_len: int | None = None, window: int | None = None,
                             k_scale: Tensor | None = None, v_scale: Tensor | None = None,
                             softcap: float | None = None) -> Tensor:
    """Causal attention of new tokens ``q: [total_q, Hq, D]`` over their sequences' paged keys.

    ``cu_seqlens_q: [B+1]`` delimits each sequence's queries in ``q``; ``seq_lens: [B]`` counts its
    cached context plus new tokens; ``block_tables: [B, max_blocks]`` maps its logical blocks to pool
    blocks; ``window`` limits each query to its last ``window`` positions; ``k_scale, v_scale`` are an 8-bit
    cache's scales; ``softcap`` soft-caps the scores. Returns ``[total_q, Hq, D]`` in ``q.dtype``.
    """
    _, group, d = _check_cache(q, k_cache, v_cache)
    ks, vs, stride_sb, stride_ss = _scales(k_cache, k_scale, v_scale)
    batch = seq_lens.shape[0]
    out = torch.empty_like(q)
    if q.shape[0] == 0:
        return out
    if max_query_len is None:
        max_query_len = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    block_m, block_n = prefill_tiles(max_query_len, d)
    grid = (triton.cdiv(max_query_len, block_m), batch, q.shape[1])
    _prefill_kernel[grid](
        q, k_cache, v_cache, ks, vs, block_tables, cu_seqlens_q, seq_lens, out,
        scale * LOG2E, _cap(softcap), k_cache.shape[1], d, _window(window),
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), stride_sb, stride_ss, block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=group, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=triton.next_power_of_2(d),
        DOT_PRECISION=_precision(q), QUANT=k_scale is not None, SOFTCAP=softcap is not None,
    )
    return out


def triton_decode_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, seq_lens: Tensor,
                            scale: float | None = None, max_seq_len: int | None = None,
                            partition_size: int = 256, window: int | None = None, k_scale: Tensor | None = None,
                            v_scale: Tensor | None = None, softcap: float | None = None) -> Tensor:
    """One query token per sequence, ``q: [B, Hq, D]``, over its ``seq_lens[b]`` cached keys (the last
    ``window`` of them with a sliding window; an 8-bit cache with its scales; scores soft-capped by ``softcap``)
    -> ``[B, Hq, D]``."""
    hkv, group, d = _check_cache(q, k_cache, v_cache)
    ks, vs, stride_sb, stride_ss = _scales(k_cache, k_scale, v_scale)
    batch, hq = q.shape[0], q.shape[1]
    out = torch.empty_like(q)
    if batch == 0:
        return out
    block_n = 32
    if partition_size % block_n:
        raise ValueError(f"partition_size={partition_size} must be a multiple of {block_n}")
    if not max_seq_len:  # unknown (None or 0): read it, at the cost of a device sync
        max_seq_len = int(seq_lens.max())
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    parts = max(1, triton.cdiv(max_seq_len, partition_size))
    block_d = triton.next_power_of_2(d)
    f32 = dict(dtype=torch.float32, device=q.device)
    part_out = torch.empty(batch, hq, parts, block_d, **f32)
    part_m = torch.empty(batch, hq, parts, **f32)
    part_l = torch.empty(batch, hq, parts, **f32)
    _decode_partition_kernel[(batch, hkv, parts)](
        q, k_cache, v_cache, ks, vs, block_tables, seq_lens, part_out, part_m, part_l,
        scale * LOG2E, _cap(softcap), k_cache.shape[1], d, parts, _window(window),
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), stride_sb, stride_ss, block_tables.stride(0),
        GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_N=block_n, BLOCK_D=block_d,
        PARTITION=partition_size, DOT_PRECISION=_precision(q), QUANT=k_scale is not None,
        SOFTCAP=softcap is not None,
    )
    _decode_reduce_kernel[(batch, hq)](
        part_out, part_m, part_l, out, d, parts, out.stride(0), out.stride(1),
        BLOCK_P=triton.next_power_of_2(parts), BLOCK_D=block_d,
    )
    return out

