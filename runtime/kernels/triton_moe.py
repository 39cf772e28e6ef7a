"""Grouped GEMM for mixture-of-experts layers in Triton: every active expert's tokens in one launch.

The router's (token, slot) pairs are sorted by expert, so each expert's rows form one contiguous run of
the sorted order; the runs are cut into tiles of ``BLOCK_M`` rows that never straddle two experts
(``tile_table``). One program per (row tile, ``BLOCK_N`` column tile) computes ``rows @ W[e].T`` for
its tile's expert ``e``: rows are gathered from ``x`` through the sorted token ids (gate/up) or read in
place (down, already in sorted order), and ``W[e]`` is an fp stack ``[E, N, K]`` or packed integers
``[E, N, words]`` (compress/format/moe_packed.py) dequantized tile by tile in registers with
runtime/kernels/triton_qmatmul.py's ``dequant_tile`` (w4a16 and the other int widths, nf4, act-order),
never materialized. ``act(gate) * up`` runs in torch between the two launches; the routing weights
scale the down outputs, summed back per token by ``index_add_``. Accumulation is fp32.
"""
from __future__ import annotations

import itertools
from collections.abc import Callable

import torch
import triton
import triton.language as tl
from torch import Tensor, nn

from compress.format.quant import nf4_codebook
from runtime.kernels.triton_qmatmul import block_sizes, dequant_tile


@triton.jit
def _grouped_kernel(
    x_ptr, rows_ptr, tile_expert_ptr, tile_start_ptr, expert_end_ptr,
    w_ptr, s_ptr, z_ptr, gidx_ptr, cb_ptr, out_ptr,
    N, K, group_size,
    stride_xm, stride_xk, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sg,
    stride_ze, stride_zn, stride_zg, stride_ge, stride_om, stride_on,
    GATHER: tl.constexpr, QUANT: tl.constexpr, BITS: tl.constexpr, HAS_ZEROS: tl.constexpr,
    HAS_GIDX: tl.constexpr, IS_NF4: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    tile, pid_n = tl.program_id(0), tl.program_id(1)
    e = tl.load(tile_expert_ptr + tile).to(tl.int64)
    start = tl.load(tile_start_ptr + tile)
    end = tl.load(expert_end_ptr + e)  # this expert's run of sorted rows ends here
    offs_m = start + tl.arange(0, BLOCK_M)  # sorted rows of this tile
    m_ok = offs_m < end
    if GATHER:  # gate/up: the rows are tokens of x, in expert order
        rows = tl.load(rows_ptr + offs_m, mask=m_ok, other=0).to(tl.int64)
    else:
        rows = offs_m.to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        x = tl.load(x_ptr + rows[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)  # [BM, BK]
        if QUANT:
            w = dequant_tile(w_ptr + e * stride_we, s_ptr + e * stride_se, z_ptr + e * stride_ze,
                             gidx_ptr + e * stride_ge, cb_ptr, offs_k, k_ok, offs_n, n_ok, group_size,
                             stride_wn, stride_wk, stride_sn, stride_sg, stride_zn, stride_zg,
                             BITS, HAS_ZEROS, HAS_GIDX, IS_NF4)
        else:
            w = tl.load(w_ptr + e * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk,
                        mask=k_ok[:, None] & n_ok[None, :], other=0.0)  # [BK, BN] = W[e].T tile
        acc += tl.dot(x, w.to(x.dtype), input_precision=DOT_PRECISION)
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on,
             acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def tile_table(counts: list[int], block_m: int, device) -> tuple[Tensor, Tensor, Tensor]:
    """(expert of each row tile, first sorted row of each tile, end of each expert's run) as int32 tensors."""
    ends = list(itertools.accumulate(counts))
    experts, starts = [], []
    for e, (n, end) in enumerate(zip(counts, ends)):
        for r in range(end - n, end, block_m):
            experts.append(e)
            starts.append(r)

    def i32(v: list[int]) -> Tensor:
        return torch.tensor(v, dtype=torch.int32, device=device)

    return i32(experts), i32(starts), i32(ends)


def grouped_matmul(x: Tensor, rows: Tensor | None, lin: nn.Module, table: tuple[Tensor, Tensor, Tensor],
                   num_rows: int, block: tuple[int, int, int]) -> Tensor:
    """``out[r] = x[rows[r]] @ W[e(r)].T`` for the ``num_rows`` sorted rows (``rows=None``: ``x[r]``) -> ``[R, N]``.

    ``lin`` is a stack of ``E`` linears: ``StackedLinears`` (``weight [E, N, K]``) or ``PackedLinears``.
    """
    n_out, k_in = lin.out_features, lin.in_features
    out = torch.empty(num_rows, n_out, dtype=x.dtype, device=x.device)
    tile_e, tile_s, ends = table
    if num_rows == 0:
        return out
    quant = hasattr(lin, "qweight")
    w = lin.qweight if quant else lin.weight
    s = lin.scales if quant else w  # unused pointers get any tensor of the right rank
    scheme = lin.scheme if quant else None
    is_nf4 = quant and scheme.format == "nf4"
    z = lin.qzeros if quant and lin.qzeros is not None and not is_nf4 else s
    g = lin.g_idx if quant and lin.g_idx is not None else s
    cb = nf4_codebook(x.device) if is_nf4 else s
    bm, bn, bk = block
    grid = (tile_e.numel(), triton.cdiv(n_out, bn))
    _grouped_kernel[grid](
        x, x if rows is None else rows, tile_e, tile_s, ends, w, s, z, g, cb, out,
        n_out, k_in, scheme.group(k_in) if quant else 1,
        x.stride(0), x.stride(1), w.stride(0), w.stride(1), w.stride(2), s.stride(0), s.stride(1), s.stride(2),
        z.stride(0), z.stride(1), z.stride(2), g.stride(0), out.stride(0), out.stride(1),
        GATHER=rows is not None, QUANT=quant, BITS=scheme.bits if quant else 16, HAS_ZEROS=z is not s,
        HAS_GIDX=g is not s, IS_NF4=is_nf4, DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
    )
    return out


def triton_moe_forward(x: Tensor, top_k_index: Tensor, top_k_weights: Tensor, gate_up: nn.Module, down: nn.Module,
                       act: Callable[[Tensor], Tensor]) -> Tensor:
    """Routed experts: ``x [T, H]``, ``top_k_index``/``top_k_weights [T, k]`` -> ``[T, H]`` (indices ``>= E``
    are masked slots and contribute nothing), the contract of compress's ``packed_moe_forward``."""
    k = top_k_index.shape[1]
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)  # [T * k] slots sorted by expert; masked slots last
    counts = torch.bincount(flat, minlength=gate_up.num_experts)[:gate_up.num_experts].tolist()
    num_rows = sum(counts)
    order = order[:num_rows]
    tokens = order // k  # token of each sorted slot
    block = block_sizes(max(counts, default=0), x.dtype)
    table = tile_table(counts, block[0], x.device)
    h = grouped_matmul(x, tokens, gate_up, table, num_rows, block)  # [R, 2I]
    gate, up = h.chunk(2, dim=-1)
    y = grouped_matmul(act(gate) * up, None, down, table, num_rows, block)  # [R, H]
    out = torch.zeros_like(x)
    out.index_add_(0, tokens, (y * top_k_weights.reshape(-1)[order, None]).to(out.dtype))
    return out
