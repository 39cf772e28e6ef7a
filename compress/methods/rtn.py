"""Round-to-nearest: the data-free baseline every other method is measured against. Its rounding,
:func:`compress.format.quant.quantize_weight`, is shared with the other methods and the runtime."""
from __future__ import annotations

from torch import nn

from compress.calibrate import Run, quantize_blocks
from compress.config import QuantizeConfig
from compress.format.quant import quantize_weight


# -- the adapter ---------------------------------------------------------------------------------
def quantize(model: nn.Module, cfg: QuantizeConfig, run: Run) -> None:
    """RTN (and INT8: ``bits: 8``) of every target linear and expert, in place."""
    quantize_blocks(model, cfg, run, lambda w: quantize_weight(w, cfg.scheme))
