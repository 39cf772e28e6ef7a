"""Round-to-nearest: the data-free baseline every other method is measured against."""
from __future__ import annotations

from torch import Tensor

from compress.quant import QuantizedWeight, Scheme, compute_qparams, quantize


def quantize_weight(w: Tensor, scheme: Scheme) -> QuantizedWeight:
    """RTN of ``w: [out, in]`` with min/max (asymmetric) or absmax (symmetric) qparams per group."""
    scale, zero = compute_qparams(w, scheme)
    return QuantizedWeight(quantize(w, scale, zero, scheme), scale, zero, scheme)
