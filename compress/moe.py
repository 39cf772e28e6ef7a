"""Mixture-of-experts quantization: every expert is quantized with the tokens its router actually sent
it during calibration (GPTQ with a per-expert Hessian, or AWQ's up->down scale and clipping search,
or data-free RTN/NF4), then each layer's experts are packed into one
:class:`compress.moe_packed.PackedMoEExperts`. An expert routed fewer than ``moe_min_tokens`` tokens
is RTN-quantized with a logged warning: never left in fp, never fed an empty Hessian. The router
stays in fp. Which module holds the experts is data (compress/families.py), keyed by model_type.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from compress import awq, gptq, nf4, rtn
from compress.families import FAMILIES, ExpertLayout, supported
from compress.moe_packed import PackedLinears, PackedMoEExperts
from compress.quant import QuantizedWeight, Scheme

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
                             f"compress/families.py gives it no expert layout; supported MoE types: {', '.join(supported('moe'))}")
        if cfg.moe_min_tokens is not None:
            raise ValueError(f"moe_min_tokens={cfg.moe_min_tokens} applies to mixture-of-experts models, and "
                             f"{mt!r} is dense: remove it from the recipe")
        return None
    if cfg.method == "qat":
        raise ValueError(f"method qat does not train mixture-of-experts experts ({mt}); use gptq, awq or rtn")
    return layout


def min_tokens(cfg) -> int:
    return DEFAULT_MIN_TOKENS if cfg.moe_min_tokens is None else cfg.moe_min_tokens


def _data_free(w: Tensor, scheme: Scheme) -> QuantizedWeight:
    return nf4.quantize_weight(w, scheme.group_size) if scheme.format == "nf4" else rtn.quantize_weight(w, scheme)


def _intermediate(x: Tensor, w_gu: Tensor, act) -> Tensor:
    """The down projection's input ``act(gate) * up`` for routed tokens ``x [n, H]``."""
    gate, up = (x @ w_gu.T).chunk(2, dim=-1)
    return act(gate) * up


@dataclass
class ExpertResult:
    gate_up: QuantizedWeight
    down: QuantizedWeight
    losses: dict[str, float]


def quantize_expert_rtn(w_gu: Tensor, w_down: Tensor, scheme: Scheme) -> ExpertResult:
    return ExpertResult(_data_free(w_gu, scheme), _data_free(w_down, scheme), {})


def quantize_expert_gptq(w_gu: Tensor, w_down: Tensor, x: Tensor, act, cfg) -> ExpertResult:
    """GPTQ of one expert on its routed tokens ``x [n, H]``; the down projection's Hessian is taken on
    the outputs of the already quantized gate/up (sequential within the expert)."""
    h = gptq.Hessian.zeros(x.shape[1])
    h.add(x)
    gu = gptq.quantize_weight(w_gu, h.H, cfg.scheme, cfg.damp, cfg.block_size, cfg.act_order, cfg.static_groups)
    inter = _intermediate(x, gu.weight.dequantize(), act)
    h = gptq.Hessian.zeros(inter.shape[1])
    h.add(inter)
    dn = gptq.quantize_weight(w_down, h.H, cfg.scheme, cfg.damp, cfg.block_size, cfg.act_order, cfg.static_groups)
    return ExpertResult(gu.weight, dn.weight, {"gate_up_proj": gu.loss, "down_proj": dn.loss})


def quantize_expert_awq(w_gu: Tensor, w_down: Tensor, x: Tensor, act, cfg) -> ExpertResult:
    """AWQ of one expert: scale search between up and down (the only op private to the expert; the
    norm before gate/up is shared with the router and every other expert), then clipping search."""
    scheme = cfg.scheme
    w_gu, w_down = w_gu.float().clone(), w_down.float().clone()
    inter_all = _intermediate(x, w_gu, act)  # [n, I]
    rows = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(cfg.seed))[:cfg.search_tokens]
    x, inter = x[rows], inter_all[rows]  # a fixed sample of the routed tokens for the searches
    ref = inter @ w_down.T
    res = awq.search_scale(inter_all.abs().mean(0), [w_down], scheme, lambda ws: inter @ ws[0].T, ref, cfg.grid)
    s = res.scales  # [I]: up rows / s, down columns * s leaves the fp expert unchanged
    n_i = w_down.shape[1]
    w_gu[n_i:] /= s[:, None]
    w_down *= s
    inter = inter / s
    if cfg.clip:
        w_gu = awq.clip_weight(w_gu, awq.search_clip(x[:512], w_gu, scheme, cfg.grid), scheme)
        w_down = awq.clip_weight(w_down, awq.search_clip(inter[:512], w_down, scheme, cfg.grid), scheme)
    return ExpertResult(rtn.quantize_weight(w_gu, scheme), rtn.quantize_weight(w_down, scheme),
                        {"down_proj": res.loss, "down_proj_rtn": res.base_loss})


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


def quantize_experts(experts: nn.Module, layout: ExpertLayout, cfg, routed: RoutedInputs | None,
                     where: str = "") -> tuple[PackedMoEExperts, list[dict]]:
    """Quantize each expert of a fused experts module; returns the packed module and one record per expert."""
    w_gu_all = getattr(experts, layout.gate_up).data
    w_dn_all = getattr(experts, layout.down).data
    n_experts = w_gu_all.shape[0]
    calibrated = cfg.method in ("gptq", "awq")
    assert not calibrated or routed is not None, "calibrated expert quantization needs routed inputs"
    need = min_tokens(cfg)
    gate_ups, downs, records, fallback = [], [], [], []
    for e in range(n_experts):
        w_gu, w_dn = w_gu_all[e].float(), w_dn_all[e].float()
        x = routed.tokens(e).float() if calibrated else None
        n = 0 if x is None else x.shape[0]
        if not calibrated:
            res = quantize_expert_rtn(w_gu, w_dn, cfg.scheme)
        elif n < need:
            fallback.append(e)
            res = quantize_expert_rtn(w_gu, w_dn, cfg.scheme)
        elif cfg.method == "gptq":
            res = quantize_expert_gptq(w_gu, w_dn, x, experts.act_fn, cfg)
        else:
            res = quantize_expert_awq(w_gu, w_dn, x, experts.act_fn, cfg)
        gate_ups.append(res.gate_up)
        downs.append(res.down)
        records.append({"expert": e, "tokens": n, "fallback": e in fallback, **res.losses})
    if fallback:
        counts = {e: records[e]["tokens"] for e in fallback}
        log.warning("%s: %d of %d experts got fewer than %d routed calibration tokens %s; they are RTN-quantized "
                    "(more calibration data, or a lower moe_min_tokens, calibrates them)", where or "experts",
                    len(fallback), n_experts, need, counts)
    packed = PackedMoEExperts(PackedLinears.from_quantized(gate_ups), PackedLinears.from_quantized(downs),
                              experts.act_fn)
    packed.rtn_fallback = fallback
    return packed, records


def _swap(block: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(block.get_submodule(parent) if parent else block, child, module)


def experts_of(block: nn.Module, layout: ExpertLayout) -> nn.Module | None:
    """The block's fused experts module, or ``None`` (a dense layer inside a MoE model, e.g. qwen2_moe's
    ``mlp_only_layers``)."""
    try:
        m = block.get_submodule(layout.experts)
    except AttributeError:
        return None
    return m if isinstance(getattr(m, layout.gate_up, None), nn.Parameter) else None


def quantize_block_experts(i: int, block: nn.Module, layout: ExpertLayout, cfg, inputs=None) -> list[dict]:
    """Quantize and pack the experts of decoder block ``i``; ``inputs`` (compress.calibrate.BlockInputs)
    are run through the block to capture each expert's routed tokens when the method calibrates."""
    experts = experts_of(block, layout)
    if experts is None:
        return []
    routed = None
    if cfg.method in ("gptq", "awq"):
        routed = RoutedInputs()
        handle = experts.register_forward_pre_hook(routed.hook, with_kwargs=True)
        try:
            inputs.forward(block)
        finally:
            handle.remove()
    packed, records = quantize_experts(experts, layout, cfg, routed, f"layer {i}")
    _swap(block, layout.experts, packed)
    return [{"layer": i, **r} for r in records]


# -- checkpoint ----------------------------------------------------------------------------------
def moe_entries(model: nn.Module) -> dict[str, dict]:
    """``quantization_config["moe"]``: every packed experts module, its scheme, shapes and fallbacks."""
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, PackedMoEExperts):
            out[name] = {**m.gate_up_proj.scheme.to_dict(), "act_order": m.gate_up_proj.g_idx is not None,
                         "num_experts": m.num_experts, "hidden_size": m.hidden_dim,
                         "intermediate_size": m.intermediate_dim, "gate_up": "concatenated",
                         "projections": {"gate_up_proj": [2 * m.intermediate_dim, m.hidden_dim],
                                         "down_proj": [m.hidden_dim, m.intermediate_dim]},
                         "rtn_fallback": list(getattr(m, "rtn_fallback", []))}
    return out


def swap_in_packed_experts(model: nn.Module, entries: dict[str, dict]) -> None:
    """Replace each named fused experts module by an empty :class:`PackedMoEExperts` of the recorded scheme."""
    from compress.checkpoint import scheme_of

    for name, entry in entries.items():
        old = model.get_submodule(name)
        packed = PackedMoEExperts.empty(entry["num_experts"], entry["hidden_size"], entry["intermediate_size"],
                                        scheme_of(entry), old.act_fn, entry.get("act_order", False))
        packed.rtn_fallback = list(entry.get("rtn_fallback", []))
        _swap(model, name, packed)
