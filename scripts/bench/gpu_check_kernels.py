"""The kernel sections of scripts/bench/gpu_check.py: memory bandwidth, paged decode attention, the int4 GEMM.

Each Triton kernel is checked against its torch reference on the same inputs before it is timed. Timings are
medians of CUDA-event (or, on CPU, perf_counter) samples after warm-up; each sample runs the call ``inner``
times and divides, so launch overhead counts as the engine sees it. Inputs rotate through copies large enough
together to miss the L2 cache (50 MB on an H100), as a model's many layers do.
"""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

L2_MISS_BYTES = 256 << 20  # rotate through at least this many bytes of inputs


@dataclass(frozen=True)
class KernelPlan:
    """What to time: the full grid on a GPU, a tiny one for the CPU dry run (Triton's interpreter)."""

    dtype: torch.dtype
    copy_bytes: int  # the bandwidth probe's buffer
    heads: tuple[int, int, int]  # (query heads, KV heads, head dim)
    block_size: int
    decode_cases: tuple[tuple[int, int], ...]  # (batch, context length)
    gemm_shapes: tuple[tuple[int, int], ...]  # (out features, in features)
    gemm_rows: tuple[int, ...]
    group_size: int
    warmup: int
    samples: int
    inner: int
    max_copies: int


# the 1b shape's attention (32 query heads over 8 KV heads of 64) and linears, and Llama 3 8B's MLP
GPU_PLAN = KernelPlan(
    dtype=torch.bfloat16, copy_bytes=1 << 30, heads=(32, 8, 64), block_size=16,
    decode_cases=((1, 4096), (1, 32768), (8, 4096), (32, 2048), (64, 1024), (64, 4096)),
    gemm_shapes=((8192, 2048), (2048, 8192), (2048, 2048), (14336, 4096)), gemm_rows=(1, 8, 32), group_size=64,
    warmup=5, samples=10, inner=20, max_copies=128)
DRY_PLAN = KernelPlan(
    dtype=torch.float32, copy_bytes=16 << 20, heads=(4, 2, 32), block_size=16, decode_cases=((1, 40), (3, 70)),
    gemm_shapes=((96, 64), (64, 96)), gemm_rows=(1, 8, 32), group_size=32, warmup=1, samples=2, inner=1, max_copies=2)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(fn: Callable[[int], object], device: torch.device, plan: KernelPlan) -> float:
    """Median milliseconds of one ``fn(i)`` (``i`` picks the input copy), over ``plan.samples`` samples."""
    for i in range(plan.warmup):
        fn(i)
    sync(device)
    times, k = [], 0
    for _ in range(plan.samples):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(plan.inner):
                fn(k)
                k += 1
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / plan.inner)
        else:
            t0 = time.perf_counter()
            for _ in range(plan.inner):
                fn(k)
                k += 1
            times.append(1000 * (time.perf_counter() - t0) / plan.inner)
    return statistics.median(times)


def sig(x: float, digits: int = 4) -> float:
    """``x`` to ``digits`` significant figures (JSON stays readable at every scale)."""
    return float(f"{x:.{digits}g}")


def copies_for(nbytes: int, plan: KernelPlan) -> int:
    return max(1, min(plan.max_copies, math.ceil(L2_MISS_BYTES / max(nbytes, 1))))


def bandwidth(device: torch.device, plan: KernelPlan) -> dict:
    """A device-to-device copy of ``copy_bytes``: bytes read plus bytes written, per second."""
    src = torch.empty(plan.copy_bytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    ms = median_ms(lambda i: dst.copy_(src), device, plan)
    gbs = 2 * plan.copy_bytes / ms / 1e6
    del src, dst
    return {"copy_bytes": plan.copy_bytes, "copy_ms": sig(ms), "gb_s": sig(gbs)}


def _paged_inputs(batch: int, ctx: int, copies: int, plan: KernelPlan, device: torch.device, seed: int):
    """q [B, Hq, D]; one pool holding ``copies`` disjoint sets of blocks; a shuffled block table per copy."""
    hq, hkv, d = plan.heads
    bs = plan.block_size
    per_seq = math.ceil(ctx / bs)
    n_blocks = copies * batch * per_seq
    gen = torch.Generator(device=device).manual_seed(seed)  # drawn where they are used: no host copy of the pool
    rand = dict(generator=gen, device=device, dtype=plan.dtype)
    k_cache, v_cache = torch.randn(n_blocks, bs, hkv, d, **rand), torch.randn(n_blocks, bs, hkv, d, **rand)
    perm = torch.randperm(n_blocks, generator=torch.Generator().manual_seed(seed)).to(torch.int32)
    per_copy = batch * per_seq
    tables = [perm[c * per_copy:(c + 1) * per_copy].view(batch, per_seq).to(device) for c in range(copies)]
    q = torch.randn(batch, hq, d, **rand)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    return q, k_cache, v_cache, tables, seq_lens


def _decode_meta(table: torch.Tensor, seq_lens: torch.Tensor, ctx: int):
    """AttentionMetadata for a pure decode batch (one new token each), as the model runner builds it."""
    from runtime.kernels.attention import AttentionMetadata

    dev, b = table.device, table.shape[0]
    i32 = dict(dtype=torch.int32, device=dev)
    return AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.long, device=dev), num_prefill_tokens=0,
        prefill_cu_seqlens_q=torch.zeros(1, **i32), prefill_seq_lens=torch.zeros(0, **i32),
        prefill_block_tables=torch.zeros(0, 1, **i32), prefill_q_lens=[], prefill_ctx_lens=[],
        decode_q_lens=[1] * b, decode_cu_seqlens_q=torch.arange(b + 1, **i32), decode_seq_lens=seq_lens,
        decode_block_tables=table, max_decode_seq_len=ctx)


def decode_case(batch: int, ctx: int, plan: KernelPlan, device: torch.device, bw_gbs: float) -> dict:
    """Triton flash-decoding against the torch path on one (batch, context): error, time, fraction of bandwidth."""
    from runtime.kernels.attention import decode_attention
    from runtime.kernels.triton_attention import triton_decode_attention

    hq, hkv, d = plan.heads
    elem = torch.finfo(plan.dtype).bits // 8
    kv_bytes = 2 * batch * ctx * hkv * d * elem  # K and V of every context token, read once
    copies = copies_for(kv_bytes, plan)
    q, k_cache, v_cache, tables, seq_lens = _paged_inputs(batch, ctx, copies, plan, device, batch * 7919 + ctx)
    metas = [_decode_meta(t, seq_lens, ctx) for t in tables]
    scale = 1.0 / math.sqrt(d)

    def tri(i: int):
        return triton_decode_attention(q, k_cache, v_cache, tables[i % copies], seq_lens, scale, max_seq_len=ctx)

    def ref(i: int):
        return decode_attention(q, k_cache, v_cache, metas[i % copies], scale)

    err = (tri(0).float() - ref(0).float()).abs().max().item()
    tri_ms, ref_ms = median_ms(tri, device, plan), median_ms(ref, device, plan)
    tri_gbs = kv_bytes / tri_ms / 1e6
    return {"batch": batch, "context": ctx, "kv_bytes": kv_bytes, "l2_rotation": copies, "max_abs_err": sig(err, 3),
            "ok": err <= tolerance(plan.dtype), "triton_ms": sig(tri_ms), "torch_ms": sig(ref_ms),
            "triton_gb_s": sig(tri_gbs), "triton_frac_of_bw": sig(tri_gbs / bw_gbs),
            "speedup_vs_torch": sig(ref_ms / tri_ms, 3)}


def tolerance(dtype: torch.dtype) -> float:
    return 1e-3 if dtype == torch.float32 else 3e-2


def decode_attention_section(plan: KernelPlan, device: torch.device, bw_gbs: float, left: Callable[[], float]) -> dict:
    hq, hkv, d = plan.heads
    cases, skipped = [], []
    for batch, ctx in plan.decode_cases:
        if left() <= 0:
            skipped.append([batch, ctx])
            continue
        cases.append(decode_case(batch, ctx, plan, device, bw_gbs))
    return {"dtype": str(plan.dtype).removeprefix("torch."), "heads_q_kv_dim": [hq, hkv, d],
            "block_size": plan.block_size, "bandwidth_gb_s": bw_gbs, "cases": cases,
            "skipped_for_time": skipped, "all_match_reference": all(c["ok"] for c in cases)}


def _int4_linear(n: int, k: int, group_size: int, gen: torch.Generator):
    """rtn4's scheme (4-bit, asymmetric, groups of ``group_size``) on a random [n, k] weight -> QuantLinear."""
    from compress.format.qlinear import QuantLinear
    from compress.format.quant import QuantizedWeight, Scheme, compute_qparams, quantize

    scheme = Scheme(bits=4, group_size=group_size, sym=False)
    w = torch.randn(n, k, generator=gen) * 0.02
    scale, zero = compute_qparams(w, scheme)
    return QuantLinear.from_quantized(QuantizedWeight(quantize(w, scale, zero, scheme), scale, zero, scheme, None))


def gemm_shape(n: int, k: int, plan: KernelPlan, device: torch.device, bw_gbs: float) -> list[dict]:
    """The Triton int4 dequant-GEMM against a dense matmul of the same (dequantized) weight in ``plan.dtype``."""
    from runtime.kernels.triton_qmatmul import triton_qmatmul

    gen = torch.Generator().manual_seed(n * 31 + k)
    ql = _int4_linear(n, k, plan.group_size, gen)
    packed = (ql.qweight.to(device), ql.scales.to(device), ql.qzeros.to(device))
    q_bytes = sum(t.numel() * t.element_size() for t in packed)
    dense = ql.dequantized_weight(plan.dtype).to(device)
    d_bytes = dense.numel() * dense.element_size()
    nq, nd = copies_for(q_bytes, plan), copies_for(d_bytes, plan)
    qs = [packed] + [tuple(t.clone() for t in packed) for _ in range(nq - 1)]
    ds = [dense] + [dense.clone() for _ in range(nd - 1)]
    rows = []
    for m in plan.gemm_rows:
        x = torch.randn(m, k, generator=gen).to(device=device, dtype=plan.dtype)

        def tri(i: int, x=x):
            qw, s, z = qs[i % nq]
            return triton_qmatmul(x, qw, s, z, ql.scheme, k)

        def ref(i: int, x=x):
            return torch.nn.functional.linear(x, ds[i % nd])

        want = ref(0).float()
        err = ((tri(0).float() - want).abs().max() / want.abs().max().clamp_min(1e-6)).item()
        tri_ms, ref_ms = median_ms(tri, device, plan), median_ms(ref, device, plan)
        rows.append({"out": n, "in": k, "m": m, "rel_err": sig(err, 3), "ok": err <= 2 * tolerance(plan.dtype),
                     "int4_ms": sig(tri_ms), "dense_ms": sig(ref_ms),
                     "speedup_vs_dense": sig(ref_ms / tri_ms, 3),
                     "int4_weight_gb_s": sig(q_bytes / tri_ms / 1e6),
                     "int4_frac_of_bw": sig(q_bytes / tri_ms / 1e6 / bw_gbs),
                     "dense_frac_of_bw": sig(d_bytes / ref_ms / 1e6 / bw_gbs)})
    return rows


def gemm_section(plan: KernelPlan, device: torch.device, bw_gbs: float, left: Callable[[], float]) -> dict:
    cases, skipped = [], []
    for n, k in plan.gemm_shapes:
        if left() <= 0:
            skipped.append([n, k])
            continue
        cases += gemm_shape(n, k, plan, device, bw_gbs)
    return {"dtype": str(plan.dtype).removeprefix("torch."), "scheme": f"int4 asym g{plan.group_size} (rtn4)",
            "bandwidth_gb_s": bw_gbs, "cases": cases, "skipped_for_time": skipped,
            "all_match_reference": all(c["ok"] for c in cases)}
