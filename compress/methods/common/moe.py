"""Mixture-of-experts quantization: every expert is quantized with the tokens its router actually sent
it during calibration, by the method's own expert quantizer (``compress.methods.gptq.quantize_expert``,
``compress.methods.awq.quantize_expert``: the same option groups as the method's dense path), or from its
weights alone (RTN/NF4), then each layer's experts are packed into one
:class:`compress.format.moe_packed.PackedMoEExperts`. An expert routed fewer than ``moe_min_tokens`` tokens
is RTN-quantized with a logged warning: never left in fp, never fed an empty Hessian. The router
stays in fp. Which module holds the experts is data (compress/format/families.py), keyed by model_type.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from compress.calibrate import BlockInputs, kept_fp
from compress.config import QuantizeConfig
from compress.format.checkpoint import moe_entries, set_module  # noqa: F401  (moe_entries: the checkpoint's record)
from compress.format.families import FAMILIES, ExpertLayout, supported
from compress.format.moe_packed import PackedLinears, PackedMoEExperts
from compress.format.quant import QuantizedWeight, Scheme, quantize_weight
from compress.methods.common.report import ExpertRecord

log = logging.getLogger(__name__)

DEFAULT_MIN_TOKENS = 32


def expert_layout(model: nn.Module, cfg) -> ExpertLayout | None:
    """The model's expert layout (``None`` for a dense model), after checking ``cfg`` fits the model."""
    from compress.calibrate import decoder_layers

    mt = model.config.model_type
    layout = FAMILIES[mt].experts if mt in FAMILIES else None
    if layout is None:
        fused = [n for n, p in decoder_layers(model)[0].named_parameters() if p.ndim == 3]
        if fused:
            raise ValueError(f"model_type {mt!r} keeps fused 3D expert weights ({', '.join(fused)}) but "
                             f"compress/format/families.py gives it no expert layout; supported MoE types: "
                             f"{', '.join(supported('moe'))}")
        if cfg.moe_min_tokens is not None:
            raise ValueError(f"moe_min_tokens={cfg.moe_min_tokens} applies to mixture-of-experts models, and "
                             f"{mt!r} is dense: remove it from the recipe")
        return None
    if cfg.method == "qat":
        raise ValueError(f"method qat does not train mixture-of-experts experts ({mt}); use gptq, awq or rtn")
    if not cfg.gptq.sequential:
        raise ValueError(f"sequential: false takes every Hessian on the fp model's activations, and a mixture-of-experts "
                         f"model's experts ({mt}) are calibrated on the quantized blocks' routed tokens: remove "
                         "sequential: false")
    return layout


def min_tokens(cfg) -> int:
    return DEFAULT_MIN_TOKENS if cfg.moe_min_tokens is None else cfg.moe_min_tokens


def intermediate(x: Tensor, w_gu: Tensor, act) -> Tensor:
    """The down projection's input ``act(gate) * up`` for routed tokens ``x [n, H]``."""
    gate, up = (x @ w_gu.T).chunk(2, dim=-1)
    return act(gate) * up


@dataclass
class ExpertResult:
    gate_up: QuantizedWeight
    down: QuantizedWeight
    losses: dict[str, float]


# a calibrated method's quantizer of one expert: (gate_up [2I, H], down [H, I], routed tokens x [n, H], act)
ExpertFn = Callable[[Tensor, Tensor, Tensor, Callable], ExpertResult]


def quantize_expert_data_free(w_gu: Tensor, w_down: Tensor, scheme: Scheme) -> ExpertResult:
    """One expert from its weights alone, on the scheme's grid (integers or the NF4 codebook)."""
    return ExpertResult(quantize_weight(w_gu, scheme), quantize_weight(w_down, scheme), {})


class RoutedInputs:
    """Captures what the router sends a layer's experts: their input and top-k choices, per batch."""

    def __init__(self):
        self.hidden: list[Tensor] = []
        self.index: list[Tensor] = []

    def hook(self, module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        index = args[1] if len(args) > 1 else kwargs["top_k_index"]
        self.hidden.append(hidden.detach().reshape(-1, hidden.shape[-1]))
        self.index.append(index.detach().reshape(-1, index.shape[-1]))  # [T, k]

    def tokens(self, e: int) -> Tensor:
        """Every calibration token routed to expert ``e`` (in any of its top-k slots): [n, H]."""
        parts = [h[(i == e).any(dim=-1)] for h, i in zip(self.hidden, self.index)]
        return torch.cat(parts) if parts else torch.empty(0)


def quantize_experts(experts: nn.Module, layout: ExpertLayout, cfg, routed: RoutedInputs | None, where: str = "",
                     expert: ExpertFn | None = None, layer: int = 0) -> tuple[PackedMoEExperts, list[ExpertRecord]]:
    """Quantize each expert of a fused experts module (of block ``layer``), by ``expert`` on its ``routed`` tokens
    (from its weights alone without ``expert``); returns the packed module and one record per expert."""
    w_gu_all = getattr(experts, layout.gate_up).data
    w_dn_all = getattr(experts, layout.down).data
    n_experts = w_gu_all.shape[0]
    calibrated = expert is not None
    assert not calibrated or routed is not None, "calibrated expert quantization needs routed inputs"
    need = min_tokens(cfg)
    gate_ups, downs, records, fallback = [], [], [], []
    for e in range(n_experts):
        w_gu, w_dn = w_gu_all[e].float(), w_dn_all[e].float()
        x = routed.tokens(e).float() if calibrated else None
        n = 0 if x is None else x.shape[0]
        if calibrated and n >= need:
            res = expert(w_gu, w_dn, x, experts.act_fn)
        else:
            if calibrated:
                fallback.append(e)
            res = quantize_expert_data_free(w_gu, w_dn, cfg.scheme)
        gate_ups.append(res.gate_up)
        downs.append(res.down)
        records.append(ExpertRecord(layer, e, n, e in fallback, res.losses))
    if fallback:
        counts = {e: records[e].tokens for e in fallback}
        log.warning("%s: %d of %d experts got fewer than %d routed calibration tokens %s; they are RTN-quantized "
                    "(more calibration data, or a lower moe_min_tokens, calibrates them)", where or "experts",
                    len(fallback), n_experts, need, counts)
    packed = PackedMoEExperts(PackedLinears.from_quantized(gate_ups), PackedLinears.from_quantized(downs),
                              experts.act_fn)
    packed.rtn_fallback = fallback
    return packed, records


def experts_of(block: nn.Module, layout: ExpertLayout) -> nn.Module | None:
    """The block's fused experts module, or ``None`` (a dense layer inside a MoE model, e.g. qwen2_moe's
    ``mlp_only_layers``)."""
    try:
        m = block.get_submodule(layout.experts)
    except AttributeError:
        return None
    return m if isinstance(getattr(m, layout.gate_up, None), nn.Parameter) else None


def quantize_block_experts(i: int, block: nn.Module, layout: ExpertLayout, cfg, inputs: BlockInputs | None = None,
                           expert: ExpertFn | None = None, prefix: str = "") -> list[ExpertRecord]:
    """Quantize and pack the experts of decoder block ``i`` (full name ``prefix``): by ``expert`` on the tokens
    routed to each when ``inputs`` are run through the block, or from their weights alone. Experts that
    ``cfg.ignore`` names stay in fp."""
    experts = experts_of(block, layout)
    if experts is None or kept_fp(f"{prefix}{layout.experts}", cfg.ignore):
        return []
    routed = None
    if expert is not None:
        routed = RoutedInputs()
        handle = experts.register_forward_pre_hook(routed.hook, with_kwargs=True)
        try:
            inputs.forward(block)
        finally:
            handle.remove()
    packed, records = quantize_experts(experts, layout, cfg, routed, f"layer {i}", expert, i)
    set_module(block, layout.experts, packed)
    return records


@dataclass(frozen=True)
class BlockExperts:
    """The expert step the pipeline hands a method for a MoE model (``compress.calibrate.Run.experts``):
    after block ``i``'s linears, ``step(i, block, inputs, expert)`` quantizes and packs its experts."""

    layout: ExpertLayout
    cfg: QuantizeConfig  # whole: the method's expert quantizer reads the same option groups as its dense path
    prefix: str  # the decoder blocks' full name, e.g. "model.layers"

    def __call__(self, i: int, block: nn.Module, inputs: BlockInputs | None = None,
                 expert: ExpertFn | None = None) -> list[ExpertRecord]:
        return quantize_block_experts(i, block, self.layout, self.cfg, inputs, expert, f"{self.prefix}.{i}.")
