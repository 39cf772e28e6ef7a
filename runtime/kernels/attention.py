"""Attention over the paged KV cache: the metadata contract and the torch (CPU reference) path.

The KV pool of one layer is ``k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]``;
token ``p`` of a sequence sits at slot ``block_table[p // block_size] * block_size + p % block_size``
(``slot_mapping`` gives each new token's slot). A forward's tokens are laid out as two groups:

- prefill group, first ``num_prefill_tokens`` tokens: chunks of any length, one per sequence,
  delimited by ``prefill_cu_seqlens_q``; query ``i`` of sequence ``b`` sits at position
  ``prefill_seq_lens[b] - q_len_b + i`` and sees keys ``0..`` its own position (causal after any
  cached context, so prefix-cached and chunked prefills look alike).
- decode group, the rest: sequences with a few new tokens each (1 for plain decoding, 1 + drafts
  when verifying speculative tokens), ``decode_q_lens[b]`` of them, same causal rule, with
  ``decode_seq_lens[b]`` counting the context plus the new tokens.

Callers store the new tokens' K/V first (``write_kv``), then attend; both groups read every key
through the block tables. A sliding ``window`` (Mistral, Qwen2's sliding layers) narrows each query's
keys to the last ``window`` positions, its own included: key ``j`` is visible to query position ``i``
when ``i - window < j <= i`` (transformers' ``sliding_window_overlay``); the cache keeps every key.
``paged_attention`` is what the model calls; the Triton kernels in ``runtime/kernels/triton_attention.py``
take the same tensors. An 8-bit cache (runtime/kernels/kv_quant.py) holds int8/fp8 codes in ``k_cache, v_cache``
and one fp16 scale per token and KV head in ``k_scale, v_scale: [num_blocks, block_size, num_kv_heads]``; every
function here takes them as its last two arguments (None: a cache in the compute dtype), quantizes on write and
dequantizes what it reads, prefill included, so every query sees the keys as stored.
A ``softcap`` (Gemma 2's ``attn_logit_softcapping``) bounds every score ``s = scale * q.k`` to
``tanh(s / softcap) * softcap`` before the mask and softmax; every path here takes it as a keyword (the torch
path then computes the scores itself: SDPA has no soft-capping).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from runtime.kernels.kv_quant import dequantize_kv, write_kv_quantized


@dataclass
class AttentionMetadata:
    """Where each token of one forward reads and writes K/V (see the module docstring)."""

    slot_mapping: Tensor  # [T] int64
    num_prefill_tokens: int
    prefill_cu_seqlens_q: Tensor  # [P + 1] int32
    prefill_seq_lens: Tensor  # [P] int32: cached context + new tokens
    prefill_block_tables: Tensor  # [P, max_blocks] int32
    prefill_q_lens: list[int]  # host copies, for loops on the CPU path
    prefill_ctx_lens: list[int]
    decode_q_lens: list[int]  # [D]
    decode_cu_seqlens_q: Tensor  # [D + 1] int32
    decode_seq_lens: Tensor  # [D] int32
    decode_block_tables: Tensor  # [D, max_blocks] int32
    max_decode_seq_len: int = 0
    derived: dict = field(default_factory=dict)  # per-forward tensors a backend computes once, shared by layers

    @property
    def num_decode_seqs(self) -> int:
        return len(self.decode_q_lens)

    @property
    def max_decode_q_len(self) -> int:
        return max(self.decode_q_lens, default=0)


def slots_of(block_tables: Tensor, num_positions: int, block_size: int) -> Tensor:
    """Slot of positions ``0..num_positions-1`` of every row of ``block_tables`` -> ``[B, num_positions]``."""
    pos = torch.arange(num_positions, device=block_tables.device)
    # pad tables that cover fewer positions (their extra positions are masked by the callers)
    need = -(-num_positions // block_size)
    if block_tables.shape[1] < need:
        block_tables = F.pad(block_tables, (0, need - block_tables.shape[1]))
    return block_tables[:, pos // block_size].long() * block_size + pos % block_size


def write_kv(k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, slot_mapping: Tensor,
             k_scale: Tensor | None = None, v_scale: Tensor | None = None) -> None:
    """Store ``k, v: [T, Hkv, D]`` into their slots of the pool (quantized when it has scales)."""
    if k_scale is not None:
        write_kv_quantized(k_cache, v_cache, k_scale, v_scale, k, v, slot_mapping)
        return
    k_cache.view(-1, *k.shape[1:]).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, *v.shape[1:]).index_copy_(0, slot_mapping, v)


def _take(rows: Tensor, scale_rows: Tensor | None, idx: Tensor, dtype: torch.dtype) -> Tensor:
    """``rows[idx]`` of a flat view of the pool (``[N, ..., D]``), dequantized through ``scale_rows[idx]``
    (``[N, ...]``) for an 8-bit cache."""
    x = rows.index_select(0, idx)
    return x if scale_rows is None else dequantize_kv(x, scale_rows.index_select(0, idx), dtype)


def attend(q: Tensor, k: Tensor, v: Tensor, scale: float, softcap: float | None = None, mask: Tensor | None = None,
           is_causal: bool = False, enable_gqa: bool = False) -> Tensor:
    """``F.scaled_dot_product_attention`` (``q: [..., H, n, D]``, ``k, v: [..., Hkv, L, D]``, a boolean or additive
    ``mask``), with scores soft-capped when ``softcap`` is set: then spelled out as transformers' eager attention
    does (scores in the compute dtype, softmax in fp32)."""
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale,
                                              enable_gqa=enable_gqa)
    if enable_gqa and k.shape[-3] != q.shape[-3]:
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
        v = v.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)
    s = (q @ k.transpose(-1, -2)) * scale
    s = torch.tanh(s / softcap) * softcap
    if is_causal:
        n, length = s.shape[-2], s.shape[-1]
        mask = torch.ones(n, length, dtype=torch.bool, device=s.device).tril(length - n)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask
    return torch.softmax(s.float(), dim=-1).to(q.dtype) @ v


def _decode_plan(meta: AttentionMetadata, dtype: torch.dtype, device,
                 window: int | None) -> tuple[Tensor, Tensor, Tensor | None]:
    """(block ids [D * B], additive mask [D, 1, Q, B * block_size], padded-query rows or None), once per forward
    and window (a window no sequence outgrows is no window)."""
    plan = meta.derived.get(("decode", window))
    if plan is None:
        d, q = meta.num_decode_seqs, meta.max_decode_q_len
        tables = meta.decode_block_tables
        block_size = meta.derived["block_size"]
        width = -(-(meta.max_decode_seq_len or int(meta.decode_seq_lens.max())) // block_size)
        blocks = tables[:, :width].reshape(-1).long()  # whole blocks are gathered; the mask hides the tail
        length = width * block_size
        q_lens = torch.tensor(meta.decode_q_lens, device=device)
        seq_lens = meta.decode_seq_lens.to(device=device, dtype=torch.long)
        # query j of sequence b sits at position seq_len - q_len + j and sees keys up to it
        q_pos = (seq_lens - q_lens)[:, None] + torch.arange(q, device=device)[None, :]  # [D, Q]
        q_pos = torch.minimum(q_pos, seq_lens[:, None] - 1)  # padded queries: see everything (output unused)
        keys = torch.arange(length, device=device)[None, None, :]
        mask = keys <= q_pos[:, :, None]  # [D, Q, L]
        if window is not None:
            mask &= keys > q_pos[:, :, None] - window
        pad = None
        if any(n != q for n in meta.decode_q_lens):
            rows = torch.arange(d * q, device=device).view(d, q)
            pad = rows[torch.arange(q, device=device)[None, :] < q_lens[:, None]]  # real rows of the [D*Q] layout
        bias = torch.zeros(mask.shape, dtype=dtype, device=device).masked_fill_(~mask, float("-inf"))
        plan = meta.derived[("decode", window)] = (blocks, bias[:, None], pad)
    return plan


def _effective(window: int | None, longest: int) -> int | None:
    """``window``, or None when no sequence of ``longest`` positions reaches past it (plain causal attention)."""
    return window if window is not None and longest > window else None


def decode_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata, scale: float,
                     window: int | None = None, k_scale: Tensor | None = None,
                     v_scale: Tensor | None = None, softcap: float | None = None) -> Tensor:
    """Batched attention for the decode group: ``q: [sum(decode_q_lens), Hq, D]`` -> same shape."""
    meta.derived.setdefault("block_size", k_cache.shape[1])
    window = _effective(window, meta.max_decode_seq_len or int(meta.decode_seq_lens.max()))
    blocks, mask, pad = _decode_plan(meta, q.dtype, q.device, window)
    nb, nq = meta.num_decode_seqs, meta.max_decode_q_len
    hq, d = q.shape[1], q.shape[2]
    hkv = k_cache.shape[2]
    group = hq // hkv
    if pad is not None:  # scatter the ragged queries into a [D * Q] layout
        full = q.new_zeros(nb * nq, hq, d)
        full.index_copy_(0, pad, q)
        q = full
    # gather whole blocks (contiguous rows of block_size * Hkv * D): [D, L, Hkv, D]
    n_blocks = k_cache.shape[0]
    k = _take(k_cache.view(n_blocks, -1, d), None if k_scale is None else k_scale.view(n_blocks, -1), blocks,
              q.dtype).view(nb, -1, hkv, d)
    v = _take(v_cache.view(n_blocks, -1, d), None if v_scale is None else v_scale.view(n_blocks, -1), blocks,
              q.dtype).view(nb, -1, hkv, d)
    if nq == 1:  # plain decoding: [D, Hq, D] already is [D, Hkv, G, D]; no copies
        o = attend(q.reshape(nb, hkv, group, d), k.transpose(1, 2), v.transpose(1, 2), scale, softcap, mask)
        return o.reshape(nb, hq, d)
    # fold each KV head's query heads into the query axis: [D, Q, Hkv, G, D] -> [D, Hkv, G*Q, D]
    qg = q.view(nb, nq, hkv, group, d).permute(0, 2, 3, 1, 4).reshape(nb, hkv, group * nq, d)
    m = meta.derived.get(("grouped_mask", window))
    if m is None:  # rows ordered (g, j): row g * Q + j uses query j's mask
        m = meta.derived[("grouped_mask", window)] = mask.repeat(1, 1, group, 1)
    o = attend(qg, k.transpose(1, 2), v.transpose(1, 2), scale, softcap, m)
    o = o.view(nb, hkv, group, nq, d).permute(0, 3, 1, 2, 4).reshape(nb * nq, hq, d)
    return o if pad is None else o.index_select(0, pad)


def prefill_attention(q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata,
                      scale: float, window: int | None = None, k_scale: Tensor | None = None,
                      v_scale: Tensor | None = None, softcap: float | None = None) -> Tensor:
    """Causal attention for the prefill group, one sequence at a time (its new ``k, v`` are already stored)."""
    out = torch.empty_like(q)
    block_size, hkv, d = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    k_rows = None if k_scale is None else k_scale.view(-1, hkv)
    v_rows = None if v_scale is None else v_scale.view(-1, hkv)
    start = 0
    for b, (n, ctx) in enumerate(zip(meta.prefill_q_lens, meta.prefill_ctx_lens)):
        qi = q[start:start + n].transpose(0, 1)  # [Hq, n, D]
        win = _effective(window, ctx + n)
        if ctx == 0 and win is None:  # nothing cached: attend to this chunk's own keys (as stored)
            if k_scale is None:
                ki, vi = k[start:start + n].transpose(0, 1), v[start:start + n].transpose(0, 1)
            else:
                idx = meta.slot_mapping[start:start + n]
                ki = _take(k_cache.view(-1, hkv, d), k_rows, idx, q.dtype).transpose(0, 1)
                vi = _take(v_cache.view(-1, hkv, d), v_rows, idx, q.dtype).transpose(0, 1)
            o = attend(qi, ki, vi, scale, softcap, is_causal=True, enable_gqa=True)
        else:
            idx = slots_of(meta.prefill_block_tables[b:b + 1], ctx + n, block_size)[0]
            ki = _take(k_cache.view(-1, hkv, d), k_rows, idx, q.dtype).transpose(0, 1)  # [Hkv, ctx + n, D]
            vi = _take(v_cache.view(-1, hkv, d), v_rows, idx, q.dtype).transpose(0, 1)
            keys, queries = torch.arange(ctx + n, device=q.device), torch.arange(ctx, ctx + n, device=q.device)
            mask = keys[None, :] <= queries[:, None]
            if win is not None:
                mask &= keys[None, :] > queries[:, None] - win
            o = attend(qi, ki, vi, scale, softcap, mask, enable_gqa=True)
        out[start:start + n] = o.transpose(0, 1)
        start += n
    return out


def paged_attention(q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata,
                    scale: float, window: int | None = None, k_scale: Tensor | None = None,
                    v_scale: Tensor | None = None, softcap: float | None = None) -> Tensor:
    """Store this forward's ``k, v: [T, Hkv, D]`` and attend with ``q: [T, Hq, D]`` -> ``[T, Hq, D]``."""
    write_kv(k_cache, v_cache, k, v, meta.slot_mapping, k_scale, v_scale)
    p, scales = meta.num_prefill_tokens, (k_scale, v_scale, softcap)
    if p == q.shape[0]:
        return prefill_attention(q, k, v, k_cache, v_cache, meta, scale, window, *scales)
    if p == 0:
        return decode_attention(q, k_cache, v_cache, meta, scale, window, *scales)
    return torch.cat([prefill_attention(q[:p], k[:p], v[:p], k_cache, v_cache, meta, scale, window, *scales),
                      decode_attention(q[p:], k_cache, v_cache, meta, scale, window, *scales)])


def triton_paged_attention(q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata,
                           scale: float, window: int | None = None, k_scale: Tensor | None = None,
                           v_scale: Tensor | None = None, softcap: float | None = None) -> Tensor:
    """The same contract on CUDA, through the Triton kernels (runtime/kernels/triton_attention.py)."""
    from runtime.kernels.triton_attention import triton_decode_attention, triton_prefill_attention

    write_kv(k_cache, v_cache, k, v, meta.slot_mapping, k_scale, v_scale)
    p, outs, scales = meta.num_prefill_tokens, [], dict(k_scale=k_scale, v_scale=v_scale, softcap=softcap)
    if p:
        outs.append(triton_prefill_attention(q[:p], k_cache, v_cache, meta.prefill_block_tables,
                                             meta.prefill_cu_seqlens_q, meta.prefill_seq_lens, scale,
                                             max_query_len=max(meta.prefill_q_lens), window=window, **scales))
    if q.shape[0] > p:
        if meta.max_decode_q_len == 1:
            outs.append(triton_decode_attention(q[p:], k_cache, v_cache, meta.decode_block_tables, meta.decode_seq_lens,
                                                scale, max_seq_len=meta.max_decode_seq_len, window=window, **scales))
        else:  # verifying drafts: a few queries per sequence, causal after the context
            outs.append(triton_prefill_attention(q[p:], k_cache, v_cache, meta.decode_block_tables,
                                                 meta.decode_cu_seqlens_q, meta.decode_seq_lens, scale,
                                                 max_query_len=meta.max_decode_q_len, window=window, **scales))
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def fused_paged_attention(q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata,
                          scale: float, window: int | None = None, k_scale: Tensor | None = None,
                          v_scale: Tensor | None = None, softcap: float | None = None) -> Tensor:
    """The same contract on CPU with plain-decoding queries (one per sequence) in the fused kernel
    (runtime/kernels/cpu/decode_attention.cpp: one call per layer, reading keys through the block tables in place;
    an 8-bit cache is quantized on write and dequantized in registers there too)."""
    if k_scale is None:
        torch.ops.compress_cpu.write_kv_(k_cache, v_cache, k, v, meta.slot_mapping)
    else:
        torch.ops.compress_cpu.write_kv_q8_(k_cache, v_cache, k_scale, v_scale, k, v, meta.slot_mapping)
    p, outs, scales = meta.num_prefill_tokens, [], (k_scale, v_scale, softcap)
    if p:
        outs.append(prefill_attention(q[:p], k[:p], v[:p], k_cache, v_cache, meta, scale, window, *scales))
    if q.shape[0] > p:
        if meta.max_decode_q_len == 1:
            outs.append(torch.ops.compress_cpu.paged_decode_attention(
                q[p:], k_cache, v_cache, meta.decode_block_tables, meta.decode_seq_lens, scale, window or 0, k_scale,
                v_scale, softcap or 0.0))
        else:  # verifying drafts: a few queries per sequence
            outs.append(decode_attention(q[p:], k_cache, v_cache, meta, scale, window, *scales))
    return outs[0] if len(outs) == 1 else torch.cat(outs)
