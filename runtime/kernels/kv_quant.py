"""8-bit KV cache: K and V stored as int8 or fp8 (e4m3) codes with one fp16 scale per token and KV head.

Each token's head vector ``x: [D]`` is stored as ``codes = x / s`` (int8: rounded half to even and clamped to
+-127; fp8: cast to e4m3, whose largest value is 448) with ``s = absmax(x) / qmax`` rounded to fp16, and read
back as ``codes * s`` in fp32. A per-token, per-head scale follows each row's own range (keys have a few
large channels per head, and vary by position), so no calibration is needed and a new token never rescales
old ones. The scales live in a paged tensor parallel to the codes, ``[num_blocks, block_size, Hkv]``: fp16
keeps the pool at ``D + 2`` bytes per token-head against ``2 D`` for a 16-bit cache (1.94x the tokens at
head_dim 64, 1.97x at 128). A row whose absmax rounds to a zero scale (below ~4e-6) is stored as zeros.
Writers quantize (``write_kv_quantized``); every attention path dequantizes what it reads, so a prefill
sees the same stored keys a later decode step sees.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

KV_CACHE_DTYPES = ("auto", "int8", "fp8_e4m3")
SCALE_DTYPE = torch.float16
_FP16_MAX = 65504.0


@dataclass(frozen=True)
class KVFormat:
    """How one 8-bit cache dtype stores its codes."""

    name: str
    storage: torch.dtype
    qmax: float  # largest code magnitude


def kv_format(name: str) -> KVFormat | None:
    """The format of ``name`` (EngineConfig.kv_cache_dtype), None for ``"auto"`` (the compute dtype)."""
    if name == "auto":
        return None
    if name == "int8":
        return KVFormat("int8", torch.int8, 127.0)
    if name == "fp8_e4m3":
        if not hasattr(torch, "float8_e4m3fn"):
            raise ValueError(f"kv_cache_dtype='fp8_e4m3' needs torch.float8_e4m3fn, which torch {torch.__version__} "
                             "lacks; use 'int8' or upgrade torch")
        return KVFormat("fp8_e4m3", torch.float8_e4m3fn, 448.0)
    raise ValueError(f"kv_cache_dtype={name!r} is unknown; use one of {KV_CACHE_DTYPES}")


def format_of(cache: Tensor) -> KVFormat:
    """The format whose codes ``cache`` holds."""
    fmt = kv_format("int8" if cache.dtype == torch.int8 else "fp8_e4m3")
    assert fmt is not None and cache.dtype == fmt.storage, f"{cache.dtype} is no 8-bit KV cache dtype"
    return fmt


def kv_bytes_per_token_head(head_dim: int, compute_dtype: torch.dtype, fmt: KVFormat | None) -> int:
    """Bytes one token's K (or V) takes per KV head: ``D`` elements plus, for 8-bit codes, its fp16 scale."""
    if fmt is None:
        return head_dim * compute_dtype.itemsize
    return head_dim * fmt.storage.itemsize + SCALE_DTYPE.itemsize


def quantize_kv(x: Tensor, fmt: KVFormat) -> tuple[Tensor, Tensor]:
    """``x: [T, H, D]`` -> (codes ``[T, H, D]`` in ``fmt.storage``, scales ``[T, H]`` fp16)."""
    xf = x.float()
    scale = (xf.abs().amax(-1) / fmt.qmax).clamp_(max=_FP16_MAX).to(SCALE_DTYPE)
    s = scale.float()
    y = xf / torch.where(s > 0, s, torch.ones_like(s))[..., None]  # the stored scale, so codes * s is the round trip
    if fmt.storage == torch.int8:
        codes = y.round_().clamp_(-fmt.qmax, fmt.qmax).to(torch.int8)
    else:
        codes = y.clamp_(-fmt.qmax, fmt.qmax).to(fmt.storage)
    return codes, scale


def dequantize_kv(codes: Tensor, scales: Tensor, dtype: torch.dtype) -> Tensor:
    """``codes: [..., D]`` with ``scales: [...]`` -> ``codes * scales`` in ``dtype`` (the product taken in fp32)."""
    return (codes.float() * scales.float()[..., None]).to(dtype)


def _store(cache: Tensor, rows: Tensor, slots: Tensor) -> None:
    """``cache.view(-1, ...)[slots] = rows`` (through uint8: CPU index_copy_ has no fp8 kernel)."""
    if cache.dtype.itemsize == 1 and cache.dtype != torch.uint8:
        cache, rows = cache.view(torch.uint8), rows.view(torch.uint8)
    cache.view(-1, *rows.shape[1:]).index_copy_(0, slots, rows)


def write_kv_quantized(k_cache: Tensor, v_cache: Tensor, k_scale: Tensor, v_scale: Tensor, k: Tensor, v: Tensor,
                       slot_mapping: Tensor) -> None:
    """Quantize ``k, v: [T, Hkv, D]`` and store codes and scales in their slots of the pool."""
    fmt = format_of(k_cache)
    for cache, scales, x in ((k_cache, k_scale, k), (v_cache, v_scale, v)):
        codes, s = quantize_kv(x, fmt)
        _store(cache, codes, slot_mapping)
        scales.view(-1, s.shape[1]).index_copy_(0, slot_mapping, s)
