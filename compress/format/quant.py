"""Shared quantization primitives: schemes, qparams, quantize/dequantize, pack/unpack.

Conventions (every exporter and kernel relies on these):
- A weight is ``w: [out, in]``; groups run along ``in``. ``group_size=-1`` is one group per row.
  A ``group_size`` that does not divide ``in`` leaves a ragged last group of ``in % group_size``
  columns; ``n_groups = ceil(in / group_size)``.
- Codes ``q`` are unsigned integers in ``[0, 2**bits - 1]``; ``w ~= (q - zero) * scale``.
  Symmetric schemes store no zeros: their zero is ``2**(bits-1)`` and their scale
  ``absmax / (2**(bits-1) - 1)``, so every weight is within half a step.
  Asymmetric schemes store integer zeros in ``[zero_floor, 2**bits - 1]`` (``zero_floor`` 0, or 1 so that
  GPTQ v1's ``zero - 1`` never wraps: a group whose zero would round to 0 then takes zero 1 and the scale
  ``hi / (maxq - 1)``, one step of its range given up).
- ``nf4`` uses the NormalFloat4 codebook: ``w ~= NF4[q] * scale`` with ``scale`` the group absmax.
- Scales are float16 (what GPTQ/AWQ/ONNX Runtime consume), and codes are always computed from
  the float16-rounded scale, so exporting never re-rounds anything.
- Packing: ``32 // bits`` codes per int32 word along ``in`` (2->16, 3->10, 4->8, 8->4); code ``j``
  of a word sits at bits ``[j*bits, (j+1)*bits)``, least significant first; ``in`` is padded
  with zero codes up to a whole word. 3-bit words leave their top 2 bits zero.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

BITS = (2, 3, 4, 8)
FORMATS = ("int", "nf4")
# NormalFloat4 (Dettmers et al., 2023): quantiles of N(0, 1) scaled to [-1, 1], with an exact zero.
NF4_CODEBOOK = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
)
MIN_SCALE = 1e-6


@dataclass(frozen=True)
class Scheme:
    """How one linear's weight is quantized."""

    bits: int = 4
    group_size: int = 128  # -1: per output channel
    sym: bool = False
    format: str = "int"
    zero_floor: int = 0  # asymmetric: the smallest zero point stored (1: every zero fits GPTQ v1)

    def __post_init__(self):
        if self.bits not in BITS:
            raise ValueError(f"bits={self.bits} is not supported; use one of {BITS}")
        if self.group_size != -1 and self.group_size < 8:
            raise ValueError(f"group_size={self.group_size} is out of range; use -1 (per channel) or >= 8")
        if self.format not in FORMATS:
            raise ValueError(f"format={self.format!r} is unknown; use one of {FORMATS}")
        if self.format == "nf4" and self.bits != 4:
            raise ValueError(f"nf4 is a 4-bit format, got bits={self.bits}")
        if self.zero_floor not in (0, 1) or (self.zero_floor and not self.has_zeros):
            raise ValueError(f"zero_floor={self.zero_floor} must be 0, or 1 for an asymmetric int scheme")

    @property
    def maxq(self) -> int:
        return 2**self.bits - 1

    @property
    def sym_zero(self) -> int:
        return 2 ** (self.bits - 1)

    @property
    def has_zeros(self) -> bool:
        return self.format == "int" and not self.sym

    def group(self, in_features: int) -> int:
        """The effective group size for a row of ``in_features`` (per channel -> the whole row)."""
        return in_features if self.group_size == -1 else self.group_size

    def n_groups(self, in_features: int) -> int:
        return math.ceil(in_features / self.group(in_features))

    def to_dict(self) -> dict:
        out = {"bits": self.bits, "group_size": self.group_size, "sym": self.sym, "format": self.format}
        return {**out, "zero_floor": self.zero_floor} if self.zero_floor else out


def nf4_codebook(device=None) -> Tensor:
    return torch.tensor(NF4_CODEBOOK, dtype=torch.float32, device=device)


def fp16_ceil(s: Tensor) -> Tensor:
    """Round positive scales to the nearest float16 at or above them, so a group's range still fits in
    ``maxq`` steps after rounding (rounding down would clip the top code by up to maxq * 2**-11 steps)."""
    h = s.half()
    return torch.where(h.float() < s, torch.nextafter(h, torch.full_like(h, float("inf"))), h)


def _floor_zeros(hi: Tensor, scale: Tensor, zero: Tensor, scheme: Scheme) -> tuple[Tensor, Tensor]:
    """Groups whose zero rounds below ``zero_floor`` (their min is above -scale/2) take zero ``zero_floor`` and the
    scale ``hi / (maxq - zero_floor)``, which still covers their range: one step of the grid goes below it."""
    if not scheme.zero_floor:
        return scale, zero
    low = zero < scheme.zero_floor
    lifted = fp16_ceil((hi / (scheme.maxq - scheme.zero_floor)).clamp(min=MIN_SCALE)).to(scale.dtype)
    return torch.where(low, lifted, scale), zero.clamp(min=scheme.zero_floor)


def find_params(w: Tensor, scheme: Scheme) -> tuple[Tensor, Tensor | None]:
    """Scale (fp16) and zero (int, or None) for each row of ``w: [rows, k]`` treated as one group."""
    w = w.float()
    if scheme.format == "nf4":
        scale = w.abs().amax(dim=1)
        return fp16_ceil(scale.clamp(min=MIN_SCALE)), None
    if scheme.sym:
        scale = w.abs().amax(dim=1) / (scheme.sym_zero - 1 if scheme.bits > 1 else 1)
        return fp16_ceil(scale.clamp(min=MIN_SCALE)), None
    lo = w.amin(dim=1).clamp(max=0)
    hi = w.amax(dim=1).clamp(min=0)
    scale = fp16_ceil(((hi - lo) / scheme.maxq).clamp(min=MIN_SCALE))
    zero = torch.round(-lo / scale.float()).clamp(0, scheme.maxq)
    scale, zero = _floor_zeros(hi, scale, zero, scheme)
    return scale, zero.to(torch.uint8)


def mse_params(w: Tensor, scheme: Scheme, col_weight: Tensor | None = None, grid: int = 100,
               max_shrink: float = 0.8, norm: float = 2.4, coarse: int = 0) -> tuple[Tensor, Tensor | None]:
    """Like :func:`find_params`, but each row's range ``[lo, hi]`` is shrunk by the factor in
    ``[1 - max_shrink, 1]`` (steps of ``1 / grid``) that minimises ``sum_j c_j |w_j - dq(w_j)|^norm``,
    with ``c = col_weight`` (e.g. the Hessian diagonal; ones when None): the reference GPTQ's ``mse``
    grid, optionally importance-weighted. ``col_weight`` is ``[k]``, or ``[rows, k]`` to weigh each row's
    columns apart (many groups stacked as rows). ``coarse`` > 1: every ``coarse``-th step first, then the
    ``coarse - 1`` steps on either side of each row's best (3x fewer candidates at 4; on SmolLM2's weights 98.7%
    of rows pick the same step and the summed error rises 0.02%). Integer format only."""
    if scheme.format != "int":
        raise ValueError(f"mse_params needs format 'int', got {scheme.format!r}")
    w = w.float()
    c = torch.ones(w.shape[1]) if col_weight is None else col_weight.float().clamp(min=0)
    # find_params reads only each row's min and max, and shrinking w by p > 0 shrinks them by p exactly (rounding is
    # monotonic): the qparams of every candidate from the two ends, not from a scaled copy of w
    ends = torch.stack([w.amin(1), w.amax(1)], 1)
    steps, stride = int(grid * max_shrink), max(coarse, 1)

    def error(factor) -> tuple[Tensor, Tensor | None, Tensor]:  # factor: a float, or one per row [rows, 1]
        s, z = find_params(ends * factor, scheme)
        s1 = s.float()[:, None]
        err = w.div(s1).round_()  # quantize then dequantize (format.quant's quantize, dequantize), in place
        if z is not None:
            z1 = z.float()[:, None]
            err.add_(z1).clamp_(0, scheme.maxq).sub_(z1)
        else:
            err.add_(scheme.sym_zero).clamp_(0, scheme.maxq).sub_(scheme.sym_zero)
        return s, z, err.mul_(s1).sub_(w).abs_().pow_(norm).mul_(c).sum(1)  # c: [k] or [rows, k]

    best_s, best_z, best_err = error(1.0)
    best_k = torch.zeros(w.shape[0], dtype=torch.long)

    def keep(k, s: Tensor, z: Tensor | None, err: Tensor) -> None:
        nonlocal best_s, best_z, best_err, best_k
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_s = torch.where(better, s, best_s)
        best_k = torch.where(better, k, best_k)
        if z is not None:
            best_z = torch.where(better, z, best_z)
    for k in range(stride, steps + 1, stride):
        keep(k, *error(1 - k / grid))
    center = best_k
    for d in [d for d in range(1 - stride, stride) if d]:  # each row's neighbours of its coarse best
        k = (center + d).clamp(0, steps)
        keep(k, *error((1 - k.double() / grid).float()[:, None]))  # the factor rounded as a Python float's would be
    return best_s, best_z


def range_candidates(grid: int, max_shrink: float, sym: bool) -> list[tuple[float, float]]:
    """The ``(lo, hi)`` shrink factors a weighted range search tries: every pair of steps of ``1 / grid`` in
    ``[1 - max_shrink, 1]`` (asymmetric: the two ends move independently), or equal pairs (symmetric)."""
    steps = [1 - k / grid for k in range(int(grid * max_shrink) + 1)]
    return [(f, f) for f in steps] if sym else [(a, b) for a in steps for b in steps]


def _range_qparams(lo: Tensor, hi: Tensor, scheme: Scheme) -> tuple[Tensor, Tensor]:
    """Float scale and zero of ranges ``[lo, hi]`` (lo <= 0 <= hi), rounded as :func:`find_params` rounds."""
    if scheme.sym:
        scale = fp16_ceil((torch.maximum(-lo, hi) / (scheme.sym_zero - 1)).clamp(min=MIN_SCALE)).float()
        return scale, torch.full_like(scale, float(scheme.sym_zero))
    scale = fp16_ceil(((hi - lo) / scheme.maxq).clamp(min=MIN_SCALE)).float()
    return _floor_zeros(hi, scale, torch.round(-lo / scale).clamp(0, scheme.maxq), scheme)


def weighted_range_params(w: Tensor, scheme: Scheme, energy: Tensor, grid: int = 20,
                          max_shrink: float = 0.5) -> tuple[Tensor, Tensor | None]:
    """Group-wise qparams of ``w: [out, in]`` (like :func:`compute_qparams`) whose range minimises each group's
    activation-weighted rounding error ``sum_j e_j (w_j - dq(w_j))^2``, ``e = energy: [in]`` the mean ``x_j^2``
    of the input channel (the diagonal of the layer's Hessian; llama.cpp's importance matrix): the expected
    output error when channels are uncorrelated, instead of the plain weight error. The full min/max range is
    always a candidate, so no group does worse under this measure than plain RTN. Integer format only."""
    if scheme.format != "int":
        raise ValueError(f"weighted_range_params needs format 'int', got {scheme.format!r}")
    out_f, in_f = w.shape
    g, n = scheme.group(in_f), scheme.n_groups(in_f)
    wg = _grouped(w.float(), n, g)  # [out, G, g]; padded columns get zero energy below
    e = _grouped(energy.float().clamp(min=0)[None, :], n, g)[0]  # [G, g]
    lo0, hi0 = wg.amin(-1).clamp(max=0), wg.amax(-1).clamp(min=0)  # [out, G]
    best_err = best_s = best_z = None
    for a, b in range_candidates(grid, max_shrink, scheme.sym):
        s, z = _range_qparams(lo0 * a, hi0 * b, scheme)
        q = (wg / s[..., None]).round_().add_(z[..., None]).clamp_(0, scheme.maxq)
        err = (q.sub_(z[..., None]).mul_(s[..., None]) - wg).pow_(2).mul_(e).sum(-1)  # [out, G]
        if best_err is None:
            best_err, best_s, best_z = err, s, z
            continue
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_s, best_z = torch.where(better, s, best_s), torch.where(better, z, best_z)
    scale = best_s.half()  # already float16 values
    return scale, None if scheme.sym else best_z.to(torch.uint8)


def group_index(in_features: int, scheme: Scheme, device=None) -> Tensor:
    """The group of each input column when columns are in natural order (ragged last group)."""
    return torch.arange(in_features, device=device) // scheme.group(in_features)


def compute_qparams(w: Tensor, scheme: Scheme) -> tuple[Tensor, Tensor | None]:
    """Group-wise qparams for ``w: [out, in]`` -> scale [out, G] fp16, zero [out, G] uint8 or None."""
    out_f, in_f = w.shape
    g, n = scheme.group(in_f), scheme.n_groups(in_f)
    # w: [out, in] -> zero-padded [out * G, g]; padding zeros never widen a range that holds 0
    padded = torch.nn.functional.pad(w.float(), (0, n * g - in_f)).reshape(out_f * n, g)
    scale, zero = find_params(padded, scheme)
    return scale.reshape(out_f, n), None if zero is None else zero.reshape(out_f, n)


def _expand(t: Tensor, g_idx: Tensor) -> Tensor:
    """Per-group [out, G] -> per-column [out, in]."""
    return t.index_select(1, g_idx.to(t.device))


def _grouped(t: Tensor, n_groups: int, g: int) -> Tensor:
    """[out, in] -> zero-padded [out, G, g] (natural column order)."""
    return torch.nn.functional.pad(t, (0, n_groups * g - t.shape[1])).reshape(t.shape[0], n_groups, g)


def _zero(zero: Tensor | None, scheme: Scheme) -> Tensor | int:
    return scheme.sym_zero if zero is None else zero.float()


def quantize(w: Tensor, scale: Tensor, zero: Tensor | None, scheme: Scheme, g_idx: Tensor | None = None) -> Tensor:
    """Integer codes (uint8) of ``w: [out, in]`` for the given qparams; ``g_idx`` maps columns to groups."""
    out_f, in_f = w.shape
    if g_idx is None:  # natural order: broadcast per-group parameters over [out, G, g]
        g, n = scheme.group(in_f), scheme.n_groups(in_f)
        x = _grouped(w.float(), n, g).div_(scale.float()[..., None])
        z = _zero(zero, scheme)
        z = z[..., None] if isinstance(z, Tensor) else z
    else:
        x = w.float() / _expand(scale, g_idx).float()
        z = _zero(zero, scheme)
        z = _expand(z, g_idx) if isinstance(z, Tensor) else z
    if scheme.format == "nf4":
        code = nf4_codebook(w.device)
        mids = (code[1:] + code[:-1]) / 2  # nearest codebook entry via midpoints (codebook is sorted)
        q = torch.bucketize(x.clamp_(-1, 1), mids)
    else:
        q = x.round_().add_(z).clamp_(0, scheme.maxq)
    return q.to(torch.uint8).reshape(out_f, -1)[:, :in_f]


def dequantize(q: Tensor, scale: Tensor, zero: Tensor | None, scheme: Scheme, g_idx: Tensor | None = None,
               dtype: torch.dtype = torch.float32) -> Tensor:
    """``q: [out, in]`` codes back to real weights of ``dtype``."""
    out_f, in_f = q.shape
    if g_idx is None:
        g, n = scheme.group(in_f), scheme.n_groups(in_f)
        s = scale.float()[..., None]
        x = _grouped(q, n, g)
        z = _zero(zero, scheme)
        z = z[..., None] if isinstance(z, Tensor) else z
    else:
        s = _expand(scale, g_idx).float()
        x = q
        z = _zero(zero, scheme)
        z = _expand(z, g_idx) if isinstance(z, Tensor) else z
    if scheme.format == "nf4":
        w = nf4_codebook(q.device)[x.long()].mul_(s)
    else:
        w = (x.float() - z).mul_(s)
    return w.reshape(out_f, -1)[:, :in_f].to(dtype)


def fake_quantize_groups(wg: Tensor, scheme: Scheme) -> Tensor:
    """RTN round trip of grouped weights ``wg: [..., g]`` (each last-dim row one group), same rounding
    as compute_qparams/quantize/dequantize; zero padding inside a group is harmless (ranges hold 0)."""
    wg = wg.float()
    if scheme.format == "nf4":
        flat = wg.reshape(-1, wg.shape[-1])
        one = Scheme(4, -1, True, "nf4")
        scale, _ = find_params(flat, one)
        return dequantize(quantize(flat, scale[:, None], None, one), scale[:, None], None, one).reshape(wg.shape)
    if scheme.sym:
        s = fp16_ceil((wg.abs().amax(-1, keepdim=True) / (scheme.sym_zero - 1)).clamp_(min=MIN_SCALE)).float()
        z = float(scheme.sym_zero)
    else:
        lo = wg.amin(-1, keepdim=True).clamp_(max=0)
        hi = wg.amax(-1, keepdim=True).clamp_(min=0)
        s = fp16_ceil(((hi - lo) / scheme.maxq).clamp_(min=MIN_SCALE)).float()
        s, z = _floor_zeros(hi, s, torch.round(-lo / s).clamp_(0, scheme.maxq), scheme)
    q = (wg / s).round_().add_(z).clamp_(0, scheme.maxq)
    return q.sub_(z).mul_(s)


def fake_quantize(w: Tensor, scheme: Scheme) -> Tensor:
    """RTN round trip of ``w: [out, in]`` with its own group-wise qparams (for searches and measurements)."""
    out_f, in_f = w.shape
    g, n = scheme.group(in_f), scheme.n_groups(in_f)
    wq = fake_quantize_groups(_grouped(w.float(), n, g), scheme)
    return wq.reshape(out_f, n * g)[:, :in_f].to(w.dtype)


def per_word(bits: int) -> int:
    return 32 // bits


def pack(q: Tensor, bits: int) -> Tensor:
    """Codes ``q: [rows, n]`` -> int32 ``[rows, ceil(n / (32 // bits))]``, least significant first."""
    assert bits in BITS
    rows, n = q.shape
    k = per_word(bits)
    words = math.ceil(n / k)
    # q: [rows, n] -> [rows, words, k] (zero padded)
    q = torch.nn.functional.pad(q.to(torch.int64), (0, words * k - n)).reshape(rows, words, k)
    shifts = torch.arange(k, device=q.device, dtype=torch.int64) * bits
    packed = (q << shifts).sum(dim=-1)  # disjoint bit ranges: sum == bitwise or
    # reinterpret as signed int32 (two's complement) without overflow
    packed = torch.where(packed >= 2**31, packed - 2**32, packed)
    return packed.to(torch.int32)


def unpack(packed: Tensor, bits: int, n: int) -> Tensor:
    """Inverse of :func:`pack`: int32 ``[rows, words]`` -> uint8 codes ``[rows, n]``."""
    assert bits in BITS
    k = per_word(bits)
    shifts = torch.arange(k, device=packed.device, dtype=torch.int32) * bits
    # [rows, words, 1] >> [k] -> [rows, words, k]; arithmetic shift is fine since we mask
    q = (packed.unsqueeze(-1) >> shifts) & (2**bits - 1)
    return q.reshape(packed.shape[0], -1)[:, :n].to(torch.uint8)


@dataclass
class QuantizedWeight:
    """The integers and parameters that stand for one linear's weight."""

    q: Tensor  # uint8 [out, in]
    scale: Tensor  # fp16 [out, G]
    zero: Tensor | None  # uint8 [out, G] for asymmetric int schemes
    scheme: Scheme
    g_idx: Tensor | None = None  # int32 [in]: group of each column when not in natural order

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        return dequantize(self.q, self.scale, self.zero, self.scheme, self.g_idx, dtype)



def quantize_weight(w: Tensor, scheme: Scheme, energy: Tensor | None = None) -> QuantizedWeight:
    """Round-to-nearest of ``w: [out, in]`` onto the scheme's grid (integers, or the NF4 codebook) with min/max
    (asymmetric) or absmax (symmetric) qparams per group: the rounding RTN, every method's fallback and the
    runtime's own quantization share. Given each input channel's activation ``energy: [in]``, each group's range
    minimises the energy-weighted error instead (:func:`weighted_range_params`)."""
    if energy is None:
        scale, zero = compute_qparams(w, scheme)
    else:
        scale, zero = weighted_range_params(w, scheme, energy)
    return QuantizedWeight(quantize(w, scale, zero, scheme), scale, zero, scheme)
