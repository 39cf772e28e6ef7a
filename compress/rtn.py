"""Round-to-nearest: the data-free baseline every other method is measured against."""
from __future__ import annotations

from torch import Tensor

from compress.quant import QuantizedWeight, Scheme, compute_qparams, quantize, weighted_range_params


def quantize_weight(w: Tensor, scheme: Scheme, energy: Tensor | None = None) -> QuantizedWeight:
    """RTN of ``w: [out, in]`` with min/max (asymmetric) or absmax (symmetric) qparams per group; given each
    input channel's activation ``energy: [in]``, each group's range minimises the energy-weighted error instead
    (:func:`compress.quant.weighted_range_params`)."""
    if energy is None:
        scale, zero = compute_qparams(w, scheme)
    else:
        scale, zero = weighted_range_params(w, scheme, energy)
    return QuantizedWeight(quantize(w, scale, zero, scheme), scale, zero, scheme)
