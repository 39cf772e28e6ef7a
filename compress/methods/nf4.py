"""NF4 (Dettmers et al., 2023): 4-bit codes index the NormalFloat codebook, scaled by each block's
absmax. Data-free; the codebook and its rounding live with the other primitives in compress/format/quant.py."""
from __future__ import annotations

from torch import Tensor, nn

from compress.calibrate import Run, quantize_blocks
from compress.config import QuantizeConfig
from compress.format import quant
from compress.format.quant import QuantizedWeight, Scheme, compute_qparams


def quantize_weight(w: Tensor, block_size: int = 64) -> QuantizedWeight:
    """NF4 codes of ``w: [out, in]`` with one fp16 absmax per block of ``block_size`` inputs."""
    scheme = Scheme(bits=4, group_size=block_size, sym=True, format="nf4")
    scale, _ = compute_qparams(w, scheme)
    return QuantizedWeight(quant.quantize(w, scale, None, scheme), scale, None, scheme)


# -- the adapter ---------------------------------------------------------------------------------
def quantize(model: nn.Module, cfg: QuantizeConfig, run: Run) -> None:
    """NF4 of every target linear and expert (blocks of ``group_size``), in place."""
    quantize_blocks(model, cfg, run, lambda w: quantize_weight(w, cfg.scheme.group_size))
