"""The export bit packings as pure functions: bijections, and the layouts the formats document."""
from __future__ import annotations

import pytest
import torch

from compress.exporters.packing import AWQ_ORDER, awq_interleave, dense_pack, dense_unpack, pack_nibbles, unpack_nibbles
from compress.format.quant import pack


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_dense_pack_is_a_bijection(bits):
    q = torch.randint(0, 2**bits, (5, 64), dtype=torch.uint8)
    packed = dense_pack(q, bits)
    assert packed.dtype == torch.int32 and packed.shape == (5, 64 * bits // 32)
    assert torch.equal(dense_unpack(packed, bits, 64), q)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_dense_pack_equals_word_packing_when_codes_fit_words(bits):
    q = torch.randint(0, 2**bits, (3, 96), dtype=torch.uint8)
    assert torch.equal(dense_pack(q, bits), pack(q, bits))


def test_three_bit_codes_straddle_words_like_autogptq():
    # code 10 sits at bits 30..32: its low two bits end word 0, its top bit starts word 1
    q = torch.zeros(1, 32, dtype=torch.uint8)
    q[0, 10] = 0b111
    words = dense_pack(q, 3)[0].to(torch.int64) & 0xFFFFFFFF
    assert words.tolist() == [0b11 << 30, 0b1, 0]
    q = torch.zeros(1, 32, dtype=torch.uint8)
    q[0, 21] = 0b110  # bit 63: low bit ends word 1, high two bits start word 2
    words = dense_pack(q, 3)[0].to(torch.int64) & 0xFFFFFFFF
    assert words.tolist() == [0, 0, 0b11]


def test_nibbles_low_first_round_trip():
    q = torch.tensor([[1, 2, 3, 15]], dtype=torch.uint8)
    assert pack_nibbles(q).tolist() == [[0x21, 0xF3]]
    r = torch.randint(0, 16, (4, 3, 32), dtype=torch.uint8)
    assert torch.equal(unpack_nibbles(pack_nibbles(r)), r)


def test_awq_interleave_puts_column_order_i_in_nibble_i():
    q = torch.arange(16, dtype=torch.uint8).reshape(1, 16) % 16
    word = pack(awq_interleave(q), 4)[0, 0].item() & 0xFFFFFFFF
    nibbles = [(word >> (4 * i)) & 0xF for i in range(8)]
    assert nibbles == list(AWQ_ORDER)
