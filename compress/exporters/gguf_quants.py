"""GGUF's 32-wide block types as pure tensor functions: pack our integers as they are, or round floats anew.

Block layouts (ggml's ``block_q4_0`` / ``block_q4_1`` / ``block_q8_0``; every block covers 32 consecutive
inputs of one row, so a row of ``n`` inputs is ``n / 32`` blocks laid end to end):
- ``Q4_0`` 18 bytes: ``d`` fp16, then 16 bytes of nibbles: byte ``j`` holds code ``j`` in its low nibble
  and code ``j + 16`` in its high nibble. ``w = d * (q - 8)``.
- ``Q4_1`` 20 bytes: ``d`` fp16, ``m`` fp16, then the same 16 nibble bytes. ``w = d * q + m``.
- ``Q8_0`` 34 bytes: ``d`` fp16, then 32 signed bytes ``q``. ``w = d * q``.
- ``Q4_K`` 144 bytes per super-block of 256 inputs (8 sub-blocks of 32): ``d``, ``dmin`` fp16, 12 bytes of
  eight 6-bit scales ``sc`` and mins ``mn``, then 128 nibble bytes (byte ``l`` of each 32-byte chunk ``k``
  holds sub-block ``2k``'s code ``l`` low and ``2k + 1``'s high). ``w = d * sc * q - dmin * mn``.
- ``Q6_K`` 210 bytes per super-block of 256 inputs (16 sub-blocks of 16): 128 bytes of low nibbles, 64 bytes of
  high 2-bit pairs, sixteen int8 scales ``sc``, then ``d`` fp16. ``w = d * sc * (q - 32)``, ``q`` in [0, 63].
  What llama.cpp's Q4_K_M writes for ``output`` (and for ``token_embd`` when the head is tied).

Our codes map onto these without rounding: a symmetric 4-bit code already is ``q`` with zero 8
(``Scheme.sym_zero``), so ``Q4_0`` stores it with ``d = scale``; an asymmetric 4-bit code keeps ``q`` and
folds its zero into ``m = -scale * zero`` (the only rounding: ``m`` to fp16); a symmetric 8-bit code is
``q - 128`` as a signed byte. The ``requantize_*`` functions are llama.cpp's own data-free rounding of
float weights (``quantize_row_q4_0_ref`` and friends), for layers whose integers do not map.
"""
from __future__ import annotations

import torch
from torch import Tensor

from compress.format.quant import fp16_ceil

BLOCK = 32
SUPER_BLOCK = 256
BYTES_PER_BLOCK = {"q4_0": 18, "q4_1": 20, "q8_0": 34, "q4_k": 144, "q6_k": 210}


def _blocks(x: Tensor) -> Tensor:
    """[..., n] -> [..., n / 32, 32]."""
    assert x.shape[-1] % BLOCK == 0, f"row length {x.shape[-1]} is not a multiple of {BLOCK}"
    return x.reshape(*x.shape[:-1], x.shape[-1] // BLOCK, BLOCK)


def _fp16_bytes(x: Tensor) -> Tensor:
    """fp16 values [..., nb] -> their little-endian bytes [..., nb, 2]."""
    return x.to(torch.float16).contiguous().view(torch.uint8).reshape(*x.shape, 2)


def _nibbles(codes: Tensor) -> Tensor:
    """4-bit codes [..., nb, 32] -> [..., nb, 16] bytes: code j low, code j + 16 high."""
    c = codes.to(torch.uint8)
    return c[..., :16] | (c[..., 16:] << 4)


def _rows(parts: list[Tensor]) -> Tensor:
    """Concatenate per-block byte fields [..., nb, k_i] and flatten each row's blocks into bytes."""
    b = torch.cat(parts, dim=-1)
    return b.reshape(*b.shape[:-2], -1).contiguous()


def pack_q4_0(codes: Tensor, d: Tensor) -> Tensor:
    """codes uint8 [..., n] in [0, 15], ``d`` fp16 [..., n / 32] -> Q4_0 bytes [..., n / 32 * 18]."""
    return _rows([_fp16_bytes(d), _nibbles(_blocks(codes))])


def pack_q4_1(codes: Tensor, d: Tensor, m: Tensor) -> Tensor:
    """codes uint8 [..., n] in [0, 15], ``d``, ``m`` [..., n / 32] -> Q4_1 bytes [..., n / 32 * 20]."""
    return _rows([_fp16_bytes(d), _fp16_bytes(m), _nibbles(_blocks(codes))])


def pack_q8_0(q: Tensor, d: Tensor) -> Tensor:
    """signed codes [..., n] in [-128, 127], ``d`` [..., n / 32] -> Q8_0 bytes [..., n / 32 * 34]."""
    assert int(q.min()) >= -128 and int(q.max()) <= 127
    signed = _blocks(q.to(torch.int8)).contiguous().view(torch.uint8)
    return _rows([_fp16_bytes(d), signed])


def _six_bits(x: Tensor) -> tuple[Tensor, Tensor]:
    """Non-negative values [..., 8] -> (fp16 super-scale [..., 1] rounded up, 6-bit multiples [..., 8])."""
    top = fp16_ceil(x.amax(dim=-1, keepdim=True).clamp(min=2**-24) / 63).float()
    return top, torch.round(x / top).clamp(0, 63).to(torch.uint8)


def pack_q4_k(codes: Tensor, scale: Tensor, minus: Tensor) -> Tensor:
    """4-bit codes [..., n] (n divisible by 256) with per-32 ``scale`` and ``minus`` (``w = scale * q - minus``,
    ``minus >= 0``) [..., n / 32] -> Q4_K bytes [..., n / 256 * 144]. The codes are kept; each super-block's
    eight scales and mins are rounded to 6-bit multiples of an fp16 step (the only change)."""
    assert codes.shape[-1] % SUPER_BLOCK == 0, f"row length {codes.shape[-1]} is not a multiple of {SUPER_BLOCK}"
    assert bool((minus >= 0).all()), "Q4_K subtracts its mins: every minus must be >= 0"
    lead, nsb = codes.shape[:-1], codes.shape[-1] // SUPER_BLOCK
    d, sc = _six_bits(scale.float().reshape(*lead, nsb, 8))  # [..., nsb, 1], [..., nsb, 8]
    dmin, mn = _six_bits(minus.float().reshape(*lead, nsb, 8))
    # 12 bytes: sc/mn 0-3 in the low 6 bits of bytes 0-3 / 4-7, whose top 2 bits hold bits 4-5 of sc/mn 4-7;
    # bytes 8-11 hold the low 4 bits of sc 4-7 (low nibble) and mn 4-7 (high nibble)
    packed = torch.cat([sc[..., :4] | ((sc[..., 4:] >> 4) << 6), mn[..., :4] | ((mn[..., 4:] >> 4) << 6),
                        (sc[..., 4:] & 0xF) | ((mn[..., 4:] & 0xF) << 4)], dim=-1)
    # codes: [..., n] -> [..., nsb, 4 chunks, 2 sub-blocks, 32] -> low | high << 4 -> [..., nsb, 128]
    q = codes.to(torch.uint8).reshape(*lead, nsb, 4, 2, BLOCK)
    qs = (q[..., 0, :] | (q[..., 1, :] << 4)).reshape(*lead, nsb, 4 * BLOCK)
    return _rows([_fp16_bytes(d[..., 0]), _fp16_bytes(dmin[..., 0]), packed, qs])


def _inverse(d: Tensor) -> Tensor:
    return torch.where(d == 0, torch.zeros_like(d), 1.0 / torch.where(d == 0, torch.ones_like(d), d))


def requantize_q4_0(w: Tensor) -> Tensor:
    """llama.cpp's Q4_0 of float weights [..., n]: ``d = max / -8`` with ``max`` the signed value of
    largest magnitude, ``q = min(15, trunc(x / d + 8.5))``."""
    x = _blocks(w.float())
    imax = x.abs().argmax(dim=-1, keepdim=True)
    d = torch.gather(x, -1, imax) / -8  # [..., nb, 1]
    q = torch.trunc(x * _inverse(d) + 8.5).clamp(0, 15)
    return _rows([_fp16_bytes(d[..., 0]), _nibbles(q)])


def requantize_q4_1(w: Tensor) -> Tensor:
    """llama.cpp's Q4_1: ``m = min``, ``d = (max - min) / 15``, ``q = min(15, trunc((x - min) / d + 0.5))``."""
    x = _blocks(w.float())
    lo, hi = x.amin(dim=-1, keepdim=True), x.amax(dim=-1, keepdim=True)
    d = (hi - lo) / 15
    q = torch.trunc((x - lo) * _inverse(d) + 0.5).clamp(0, 15)
    return _rows([_fp16_bytes(d[..., 0]), _fp16_bytes(lo[..., 0]), _nibbles(q)])


def requantize_q8_0(w: Tensor) -> Tensor:
    """llama.cpp's Q8_0: ``d = absmax / 127``, ``q = round(x / d)`` (half away from zero)."""
    x = _blocks(w.float())
    d = x.abs().amax(dim=-1, keepdim=True) / 127
    y = x * _inverse(d)
    q = (torch.sign(y) * torch.floor(y.abs() + 0.5)).clamp(-128, 127)
    signed = q.to(torch.int8).contiguous().view(torch.uint8)
    return _rows([_fp16_bytes(d[..., 0]), signed])


def _signed_absmax(x: Tensor) -> Tensor:
    """The value of largest magnitude along the last dim, with its sign, keepdim."""
    return torch.gather(x, -1, x.abs().argmax(dim=-1, keepdim=True))


def pack_q6_k(codes: Tensor, sc: Tensor, d: Tensor) -> Tensor:
    """6-bit codes [..., n] in [0, 63] (n divisible by 256), int8 sub-block scales ``sc`` [..., n / 16] and fp16
    super-block scales ``d`` [..., n / 256] -> Q6_K bytes [..., n / 256 * 210]."""
    assert codes.shape[-1] % SUPER_BLOCK == 0, f"row length {codes.shape[-1]} is not a multiple of {SUPER_BLOCK}"
    lead, nsb = codes.shape[:-1], codes.shape[-1] // SUPER_BLOCK
    u = codes.to(torch.uint8).reshape(*lead, nsb, 2, 4, BLOCK)  # [..., nsb, half, quarter, 32]
    lo, hi = u & 0xF, u >> 4
    # ql: byte l of half h holds quarter 0 (then 1)'s low nibble for l < 32 (then 32..63): low | quarter + 2 high
    ql = (lo[..., :2, :] | (lo[..., 2:, :] << 4)).reshape(*lead, nsb, 128)
    # qh: byte l of half h holds the high pairs of quarters 0..3 at bits 0, 2, 4, 6
    qh = (hi[..., 0, :] | (hi[..., 1, :] << 2) | (hi[..., 2, :] << 4) | (hi[..., 3, :] << 6)).reshape(*lead, nsb, 64)
    scales = sc.to(torch.int8).reshape(*lead, nsb, 16).contiguous().view(torch.uint8)
    return _rows([ql, qh, scales, _fp16_bytes(d.reshape(*lead, nsb))])


def requantize_q6_k(w: Tensor) -> Tensor:
    """Q6_K of float weights [..., n] (n divisible by 256), the shape of llama.cpp's ``quantize_row_q6_K_ref``
    without its per-sub-block scale search: each 16-wide sub-block's signed absmax maps to code -32, the sixteen
    scales become int8 multiples of the super-block's ``d`` (its largest scale maps to -128), then codes round."""
    x = w.float().reshape(*w.shape[:-1], w.shape[-1] // SUPER_BLOCK, 16, 16)  # [..., nsb, 16 sub-blocks, 16]
    scale = _signed_absmax(x)[..., 0] / -32  # [..., nsb, 16]
    top = _signed_absmax(scale)  # [..., nsb, 1]
    iscale = torch.where(top == 0, torch.zeros_like(top), -128 / torch.where(top == 0, torch.ones_like(top), top))
    d = _inverse(iscale).half()  # [..., nsb, 1]
    sc = torch.round(iscale * scale).clamp(-128, 127)
    step = d.float() * sc  # [..., nsb, 16]: the step each sub-block's codes are counted in
    q = torch.round(x * _inverse(step)[..., None]).clamp(-32, 31) + 32
    n = w.shape[-1]
    return pack_q6_k(q.reshape(*w.shape[:-1], n).to(torch.uint8), sc.reshape(*w.shape[:-1], n // 16), d[..., 0])


REQUANTIZE = {"q4_0": requantize_q4_0, "q4_1": requantize_q4_1, "q8_0": requantize_q8_0}
# block types a float matrix can be rounded to, with the row width each needs (llama.cpp falls back past it)
FLOAT_BLOCKS = {**REQUANTIZE, "q6_k": requantize_q6_k}
ROW_MULTIPLE = {"q4_0": BLOCK, "q4_1": BLOCK, "q8_0": BLOCK, "q6_k": SUPER_BLOCK}
