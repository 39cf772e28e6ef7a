"""Dequant-GEMM in Triton for the packed layout of compress/format/quant.py (w4a16 and the other int widths).

``y = x @ W.T (+ bias)`` where ``W[n, k] = (q[n, k] - zero[n, g(k)]) * scale[n, g(k)]`` (or
``NF4[q] * scale`` for nf4), never materializing ``W``: each program dequantizes one
``[BLOCK_K, BLOCK_N]`` tile of codes in registers and feeds it to ``tl.dot``.

Layout (compress/format/qlinear.py): ``qweight`` int32 ``[out, ceil(in / (32 // bits))]`` packed along ``in``,
code ``j`` of a word at bits ``[j*bits, (j+1)*bits)`` least significant first; ``scales`` fp16
``[out, G]``; ``qzeros`` uint8 ``[out, G]`` or None (symmetric: zero ``2**(bits-1)``); ``g_idx`` int
``[in]`` or None (natural order, ``g(k) = k // group_size``, ragged last group allowed).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from compress.format.quant import Scheme, nf4_codebook


@triton.jit
def dequant_tile(qw_ptr, s_ptr, z_ptr, gidx_ptr, cb_ptr, offs_k, k_ok, offs_n, n_ok, group_size,
                 stride_qn, stride_qw, stride_sn, stride_sg, stride_zn, stride_zg,
                 BITS: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_GIDX: tl.constexpr, IS_NF4: tl.constexpr):
    # the real-valued weight tile W.T[offs_k, offs_n] (fp32 [BK, BN], 0 outside k_ok x n_ok) of a packed
    # linear; shared by the dense dequant-GEMM here and the grouped MoE GEMM (runtime/kernels/triton_moe.py)
    kn_ok = k_ok[:, None] & n_ok[None, :]
    PER_WORD: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    SYM_ZERO: tl.constexpr = 1 << (BITS - 1)
    # each column k reads its word (k // PER_WORD) and shifts its own code down: [BK, BN]
    words = tl.load(qw_ptr + offs_n[None, :] * stride_qn + (offs_k // PER_WORD)[:, None] * stride_qw,
                    mask=kn_ok, other=0)
    q = (words >> ((offs_k % PER_WORD) * BITS)[:, None]) & MASK
    if HAS_GIDX:
        g = tl.load(gidx_ptr + offs_k, mask=k_ok, other=0)
    else:
        g = offs_k // group_size
    s = tl.load(s_ptr + offs_n[None, :] * stride_sn + g[:, None] * stride_sg, mask=kn_ok, other=0.0).to(tl.float32)
    if IS_NF4:
        w = tl.load(cb_ptr + q, mask=kn_ok, other=0.0) * s
    elif HAS_ZEROS:
        z = tl.load(z_ptr + offs_n[None, :] * stride_zn + g[:, None] * stride_zg, mask=kn_ok, other=0).to(tl.float32)
        w = (q.to(tl.float32) - z) * s
    else:
        w = (q.to(tl.float32) - SYM_ZERO) * s
    return tl.where(kn_ok, w, 0.0)


@triton.jit
def _qmatmul_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, gidx_ptr, cb_ptr, out_ptr,
    M, N, K, group_size,
    stride_xm, stride_xk, stride_qn, stride_qw, stride_sn, stride_sg, stride_zn, stride_zg, stride_om, stride_on,
    BITS: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_GIDX: tl.constexpr, IS_NF4: tl.constexpr,
    DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = offs_m < M, offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)  # [BM, BK]
        w = dequant_tile(qw_ptr, s_ptr, z_ptr, gidx_ptr, cb_ptr, offs_k, k_ok, offs_n, n_ok, group_size,
                         stride_qn, stride_qw, stride_sn, stride_sg, stride_zn, stride_zg,
                         BITS, HAS_ZEROS, HAS_GIDX, IS_NF4)
        acc += tl.dot(x, w.to(x.dtype), input_precision=DOT_PRECISION)
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on,
             acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def block_sizes(m: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K): 16 rows for decode-sized batches (tl.dot's minimum), more for prefill;
    fp32 activations take twice the shared memory per tile, so they stop at 64 rows."""
    if m <= 16:
        return 16, 64, 64
    if m <= 64 or dtype == torch.float32:
        return 64, 64, 64
    return 128, 64, 64


def triton_qmatmul(x: Tensor, qweight: Tensor, scales: Tensor, qzeros: Tensor | None, scheme: Scheme,
                   in_features: int, g_idx: Tensor | None = None, bias: Tensor | None = None) -> Tensor:
    """``x: [..., in] @ dequant(W).T -> [..., out]`` in ``x.dtype``, reading the packed weight directly."""
    out_features = qweight.shape[0]
    if x.shape[-1] != in_features:
        raise ValueError(f"x has {x.shape[-1]} input features, the weight expects in_features={in_features}")
    if scheme.bits not in (2, 3, 4, 8):
        raise ValueError(f"bits={scheme.bits} has no Triton kernel; use 2, 3, 4 or 8")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, in_features)
    m = x2.shape[0]
    out = torch.empty(m, out_features, dtype=x.dtype, device=x.device)
    if m == 0:
        return out.reshape(*lead, out_features)
    is_nf4 = scheme.format == "nf4"
    has_zeros = qzeros is not None and not is_nf4
    z = qzeros if has_zeros else scales  # any tensor: the pointer is never read
    gi = g_idx.to(torch.int32).contiguous() if g_idx is not None else scales
    cb = nf4_codebook(x.device) if is_nf4 else scales
    bm, bn, bk = block_sizes(m, x.dtype)
    grid = (triton.cdiv(m, bm), triton.cdiv(out_features, bn))
    _qmatmul_kernel[grid](
        x2, qweight, scales, z, gi, cb, out,
        m, out_features, in_features, scheme.group(in_features),
        x2.stride(0), x2.stride(1), qweight.stride(0), qweight.stride(1), scales.stride(0), scales.stride(1),
        z.stride(0), z.stride(1) if z.dim() > 1 else 0, out.stride(0), out.stride(1),
        BITS=scheme.bits, HAS_ZEROS=has_zeros, HAS_GIDX=g_idx is not None, IS_NF4=is_nf4,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
    )
    if bias is not None:
        out += bias.to(out.dtype)
    return out.reshape(*lead, out_features)

