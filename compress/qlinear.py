"""The packed quantized linear layer: stores integers, scales and zeros, never fp weights.

State dict of a ``QuantLinear`` named ``P`` (the checkpoint format, see compress/checkpoint.py):
- ``P.qweight``  int32  [out, ceil(in / (32 // bits))]  codes packed along ``in`` (compress/quant.py)
- ``P.scales``   fp16   [out, n_groups]
- ``P.qzeros``   uint8  [out, n_groups]    asymmetric int schemes only
- ``P.g_idx``    int32  [in]               only when columns are not grouped in natural order (act-order)
- ``P.bias``     fp     [out]              when the original linear had one
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from compress.quant import QuantizedWeight, Scheme, dequantize, pack, per_word, unpack


class QuantLinear(nn.Module):
    """A linear layer whose weight lives as packed integer codes plus group-wise scales/zeros."""

    def __init__(self, in_features: int, out_features: int, scheme: Scheme, bias: bool = False,
                 act_order: bool = False, dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        self.in_features, self.out_features, self.scheme = in_features, out_features, scheme
        words = -(-in_features // per_word(scheme.bits))
        n_groups = scheme.n_groups(in_features)
        self.register_buffer("qweight", torch.zeros(out_features, words, dtype=torch.int32, device=device))
        self.register_buffer("scales", torch.ones(out_features, n_groups, dtype=torch.float16, device=device))
        if scheme.has_zeros:
            self.register_buffer("qzeros", torch.zeros(out_features, n_groups, dtype=torch.uint8, device=device))
        else:
            self.qzeros = None
        if act_order:
            self.register_buffer("g_idx", torch.zeros(in_features, dtype=torch.int32, device=device))
        else:
            self.g_idx = None
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device), requires_grad=False) if bias else None
        self.compute_dtype = dtype
        self._cache: Tensor | None = None  # optional dequantized weight, see cache_weight()

    @classmethod
    def from_quantized(cls, qw: QuantizedWeight, bias: Tensor | None = None, dtype: torch.dtype = torch.float32) -> "QuantLinear":
        out_f, in_f = qw.q.shape
        m = cls(in_f, out_f, qw.scheme, bias=bias is not None, act_order=qw.g_idx is not None, dtype=dtype,
                device=qw.q.device)
        m.qweight.copy_(pack(qw.q, qw.scheme.bits))
        m.scales.copy_(qw.scale)
        if m.qzeros is not None:
            m.qzeros.copy_(qw.zero)
        if m.g_idx is not None:
            m.g_idx.copy_(qw.g_idx.to(torch.int32))
        if bias is not None:
            m.bias.data.copy_(bias.detach().to(dtype))
        return m

    def codes(self) -> Tensor:
        """The unpacked integer codes, uint8 [out, in]."""
        return unpack(self.qweight, self.scheme.bits, self.in_features)

    def quantized_weight(self) -> QuantizedWeight:
        return QuantizedWeight(self.codes(), self.scales, self.qzeros, self.scheme,
                               None if self.g_idx is None else self.g_idx.long())

    def dequantized_weight(self, dtype: torch.dtype | None = None) -> Tensor:
        """The real-valued weight ``[out, in]`` these integers stand for."""
        g_idx = None if self.g_idx is None else self.g_idx.long()
        return dequantize(self.codes(), self.scales, self.qzeros, self.scheme, g_idx, dtype or self.compute_dtype)

    def cache_weight(self, enabled: bool = True) -> None:
        """Keep a dequantized copy for repeated forwards (calibration, evaluation); off by default."""
        self._cache = self.dequantized_weight() if enabled else None

    def forward(self, x: Tensor) -> Tensor:
        w = self._cache if self._cache is not None else self.dequantized_weight(x.dtype)
        return nn.functional.linear(x, w.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))

    def extra_repr(self) -> str:
        s = self.scheme
        return (f"in={self.in_features}, out={self.out_features}, bits={s.bits}, group={s.group_size}, "
                f"sym={s.sym}, format={s.format}, act_order={self.g_idx is not None}")
