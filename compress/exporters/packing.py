"""Bit packings of the export formats, as pure tensor functions over unsigned integer codes.

- ``dense_pack``: one LSB-first bit stream per row, code ``i`` at bits ``[i*bits, (i+1)*bits)`` of the
  row's stream, cut into int32 words. For 2/4/8 bits this is compress/format/quant.py's ``pack``; for 3 bits
  a code may straddle two words (AutoGPTQ's 3-bit layout: 32 codes in 3 words).
- ``awq_interleave``: AutoAWQ GEMM's order of 8 nibbles inside a word, ``[0, 2, 4, 6, 1, 3, 5, 7]``.
- ``pack_nibbles``: ONNX Runtime's MatMulNBits byte layout, two 4-bit codes a byte, low nibble first.
"""
from __future__ import annotations

import sys

import torch
from torch import Tensor

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a word holds column AWQ_ORDER[i] of its 8


def _to_int32(words: Tensor) -> Tensor:
    """int64 words in [0, 2**32) -> int32 with the same bits."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def dense_pack(q: Tensor, bits: int) -> Tensor:
    """Codes ``q: [rows, n]`` (``n * bits`` a multiple of 32) -> int32 ``[rows, n * bits / 32]``."""
    rows, n = q.shape
    assert 1 <= bits <= 8 and (n * bits) % 32 == 0, (n, bits)
    if 8 % bits == 0 and sys.byteorder == "little":
        # codes never straddle a byte: fill bytes LSB first, then read 4 bytes as one little-endian word
        k = 8 // bits
        b = q.to(torch.uint8) & (2**bits - 1)
        byte = b[:, 0::k].clone()
        for j in range(1, k):
            byte |= b[:, j::k] << (j * bits)
        return byte.contiguous().reshape(-1).view(torch.int32).reshape(rows, n * bits // 32)
    q = q.to(torch.int64) & (2**bits - 1)
    # q: [rows, n] -> bit planes [rows, n, bits] -> stream [rows, n * bits] -> [rows, words, 32]
    planes = (q.unsqueeze(-1) >> torch.arange(bits, device=q.device)) & 1
    stream = planes.reshape(rows, -1, 32)
    words = (stream << torch.arange(32, device=q.device)).sum(-1)
    return _to_int32(words)


def dense_unpack(packed: Tensor, bits: int, n: int) -> Tensor:
    """Inverse of :func:`dense_pack`: int32 ``[rows, words]`` -> uint8 codes ``[rows, n]``."""
    rows = packed.shape[0]
    stream = (packed.to(torch.int64).unsqueeze(-1) >> torch.arange(32, device=packed.device)) & 1
    planes = stream.reshape(rows, -1)[:, : n * bits].reshape(rows, n, bits)
    return (planes << torch.arange(bits, device=packed.device)).sum(-1).to(torch.uint8)


def awq_interleave(q: Tensor) -> Tensor:
    """Reorder the columns of ``q: [rows, n]`` (n % 8 == 0) so LSB-first packing gives AWQ's order."""
    rows, n = q.shape
    assert n % 8 == 0, n
    # q: [rows, n] -> [rows, n / 8, 8], nibble slot i takes column AWQ_ORDER[i] of each block
    order = torch.tensor(AWQ_ORDER, device=q.device)
    return q.reshape(rows, n // 8, 8).index_select(2, order).reshape(rows, n)


def pack_nibbles(q: Tensor) -> Tensor:
    """4-bit codes ``q: [..., 2m]`` -> uint8 ``[..., m]``, element ``2j`` in the low nibble."""
    assert q.shape[-1] % 2 == 0, q.shape
    q = q.to(torch.uint8) & 0xF
    return q[..., 0::2] | (q[..., 1::2] << 4)


def unpack_nibbles(b: Tensor) -> Tensor:
    """Inverse of :func:`pack_nibbles`."""
    return torch.stack((b & 0xF, b >> 4), dim=-1).reshape(*b.shape[:-1], -1)
