"""Round-to-nearest: the data-free baseline every other method is measured against."""
from __future__ import annotations

from collections.abc import Callable

from torch import Tensor, nn

from compress.calibrate import Run, layers_name, run_blocks, swap_linear, target_linears
from compress.config import QuantizeConfig
from compress.format.quant import QuantizedWeight, quantize_weight


# -- the adapter ---------------------------------------------------------------------------------
def quantize_blocks(model: nn.Module, cfg: QuantizeConfig, run: Run,
                    weight: Callable[[Tensor], QuantizedWeight]) -> None:
    """A data-free method: each block's linears by ``weight`` from their weights alone, then its MoE experts."""
    prefix = layers_name(model)

    def per_block(i: int, block: nn.Module, _) -> None:
        for name, lin in target_linears(block, cfg.ignore, f"{prefix}.{i}.").items():
            swap_linear(block, name, lin, weight(lin.weight.data))
        if run.experts is not None:
            run.report.layers.extend(run.experts(i, block))
    run_blocks(model, per_block, run.progress, run.store)


def quantize(model: nn.Module, cfg: QuantizeConfig, run: Run) -> None:
    """RTN (and INT8: ``bits: 8``) of every target linear and expert, in place."""
    quantize_blocks(model, cfg, run, lambda w: quantize_weight(w, cfg.scheme))
