"""Packed quantized experts of a mixture-of-experts layer, and the CPU fused forward over them.

transformers 5.x stores a layer's experts fused in one module (``MixtralExperts``, ``Qwen2MoeExperts``,
``Qwen3MoeExperts``, ``OlmoeExperts``): ``gate_up_proj [E, 2I, H]`` (gate rows then up rows) and
``down_proj [E, H, I]``, called as ``experts(hidden [T, H], top_k_index [T, k], top_k_weights [T, k])``.
:class:`PackedMoEExperts` is a drop-in for that module holding integers only. State dict of one named
``P`` (the checkpoint format; the layout of each expert's rows is exactly compress/format/qlinear.py's):
- ``P.gate_up_proj.qweight`` int32 [E, 2I, ceil(H / (32 // bits))], ``.scales`` fp16 [E, 2I, G(H)],
  ``.qzeros`` uint8 [E, 2I, G(H)] (asymmetric int only), ``.g_idx`` int32 [E, H] (GPTQ act-order only)
- ``P.down_proj.*`` the same with out = H, in = I.
The router stays in fp and outside this module.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from compress.format.quant import QuantizedWeight, Scheme, dequantize, group_index, pack, per_word, unpack


class PackedLinears(nn.Module):
    """``E`` quantized linears of one shape stacked along a leading expert axis."""

    def __init__(self, num_experts: int, in_features: int, out_features: int, scheme: Scheme,
                 act_order: bool = False, device=None):
        super().__init__()
        self.num_experts, self.scheme = num_experts, scheme
        self.in_features, self.out_features = in_features, out_features
        E, words, G = num_experts, -(-in_features // per_word(scheme.bits)), scheme.n_groups(in_features)
        self.register_buffer("qweight", torch.zeros(E, out_features, words, dtype=torch.int32, device=device))
        self.register_buffer("scales", torch.ones(E, out_features, G, dtype=torch.float16, device=device))
        # absent buffers are registered as None so the attributes always exist
        self.register_buffer("qzeros", torch.zeros(E, out_features, G, dtype=torch.uint8, device=device)
                             if scheme.has_zeros else None)
        self.register_buffer("g_idx", torch.zeros(E, in_features, dtype=torch.int32, device=device)
                             if act_order else None)
        self._cache: Tensor | None = None

    @classmethod
    def from_quantized(cls, weights: list[QuantizedWeight]) -> "PackedLinears":
        """Stack per-expert results (same shape and scheme); experts without g_idx get natural order."""
        out_f, in_f = weights[0].q.shape
        scheme = weights[0].scheme
        assert all(w.q.shape == (out_f, in_f) and w.scheme == scheme for w in weights)
        act_order = any(w.g_idx is not None for w in weights)
        m = cls(len(weights), in_f, out_f, scheme, act_order, device=weights[0].q.device)
        for e, w in enumerate(weights):
            m.qweight[e] = pack(w.q, scheme.bits)
            m.scales[e] = w.scale
            if m.qzeros is not None:
                m.qzeros[e] = w.zero
            if m.g_idx is not None:
                m.g_idx[e] = (group_index(in_f, scheme) if w.g_idx is None else w.g_idx).to(torch.int32)
        return m

    def quantized_weight(self, e: int) -> QuantizedWeight:
        """Expert ``e``'s integers and qparams (unpacked codes, uint8 [out, in])."""
        return QuantizedWeight(unpack(self.qweight[e], self.scheme.bits, self.in_features), self.scales[e],
                               None if self.qzeros is None else self.qzeros[e], self.scheme,
                               None if self.g_idx is None else self.g_idx[e].long())

    def expert_weight(self, e: int, dtype: torch.dtype = torch.float32) -> Tensor:
        """Expert ``e``'s real-valued weight [out, in]."""
        if self._cache is not None:
            return self._cache[e].to(dtype)
        qw = self.quantized_weight(e)
        return dequantize(qw.q, qw.scale, qw.zero, qw.scheme, qw.g_idx, dtype)

    def cache_weight(self, enabled: bool = True) -> None:
        """Keep every expert dequantized (fp32) for repeated forwards; off by default."""
        self._cache = None
        if enabled:
            self._cache = torch.stack([self.expert_weight(e) for e in range(self.num_experts)])

    def extra_repr(self) -> str:
        s = self.scheme
        return (f"experts={self.num_experts}, in={self.in_features}, out={self.out_features}, bits={s.bits}, "
                f"group={s.group_size}, sym={s.sym}, format={s.format}, act_order={self.g_idx is not None}")


def packed_moe_forward(x: Tensor, top_k_index: Tensor, top_k_weights: Tensor, gate_up: PackedLinears,
                       down: PackedLinears, act: Callable[[Tensor], Tensor]) -> Tensor:
    """Routed experts over packed weights: ``x [T, H]``, ``top_k_index``/``top_k_weights [T, k]`` -> ``[T, H]``.

    (token, slot) pairs are sorted by expert so each active expert runs one matmul over a contiguous
    run of its tokens; indices ``>= E`` (transformers' masked slots) are skipped. Same arithmetic as
    transformers' eager experts: ``down(act(gate) * up) * weight``, accumulated in expert order.
    """
    T, k = top_k_index.shape
    E = gate_up.num_experts
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)  # [T * k] slots sorted by expert
    counts = torch.bincount(flat, minlength=E)[:E].tolist()
    tokens = order // k  # [T * k] token of each sorted slot
    weights = top_k_weights.reshape(-1)[order]  # [T * k]
    out = torch.zeros_like(x)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        idx = tokens[start:start + n]
        h = F.linear(x.index_select(0, idx), gate_up.expert_weight(e, x.dtype))  # [n, 2I]
        gate, up = h.chunk(2, dim=-1)
        y = F.linear(act(gate) * up, down.expert_weight(e, x.dtype)) * weights[start:start + n, None]
        out.index_add_(0, idx, y.to(out.dtype))
        start += n
    return out


class PackedMoEExperts(nn.Module):
    """Drop-in replacement for a transformers fused experts module, with packed integer weights."""

    def __init__(self, gate_up_proj: PackedLinears, down_proj: PackedLinears, act_fn: nn.Module):
        super().__init__()
        assert gate_up_proj.num_experts == down_proj.num_experts
        assert gate_up_proj.out_features == 2 * down_proj.in_features
        self.gate_up_proj, self.down_proj, self.act_fn = gate_up_proj, down_proj, act_fn
        self.num_experts = gate_up_proj.num_experts
        self.hidden_dim, self.intermediate_dim = gate_up_proj.in_features, down_proj.in_features

    @classmethod
    def empty(cls, num_experts: int, hidden: int, intermediate: int, scheme: Scheme, act_fn: nn.Module,
              act_order: bool = False) -> "PackedMoEExperts":
        return cls(PackedLinears(num_experts, hidden, 2 * intermediate, scheme, act_order),
                   PackedLinears(num_experts, intermediate, hidden, scheme, act_order), act_fn)

    def cache_weight(self, enabled: bool = True) -> None:
        self.gate_up_proj.cache_weight(enabled)
        self.down_proj.cache_weight(enabled)

    def forward(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        return packed_moe_forward(hidden_states, top_k_index, top_k_weights, self.gate_up_proj, self.down_proj,
                                  self.act_fn)
