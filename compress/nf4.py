"""NF4 (Dettmers et al., 2023): 4-bit codes index the NormalFloat codebook, scaled by each block's
absmax. Data-free; the codebook and its rounding live with the other primitives in compress/quant.py."""
from __future__ import annotations

from torch import Tensor

from compress.quant import QuantizedWeight, Scheme, compute_qparams, quantize


def quantize_weight(w: Tensor, block_size: int = 64) -> QuantizedWeight:
    """NF4 codes of ``w: [out, in]`` with one fp16 absmax per block of ``block_size`` inputs."""
    scheme = Scheme(bits=4, group_size=block_size, sym=True, format="nf4")
    scale, _ = compute_qparams(w, scheme)
    return QuantizedWeight(quantize(w, scale, None, scheme), scale, None, scheme)
