"""The sparse mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE) and how each family configures it.

Routing is transformers 5.x's ``*TopKRouter``: softmax over all experts in fp32, top-k, then the top-k
weights renormalized to sum to 1 (Mixtral always; the others when ``norm_topk_prob``). The router
weight stays fp32 and its logits are computed in fp32 whatever the model dtype. Expert outputs are
scaled by those weights (Mixtral in fp32; the others cast them to the model dtype first, as
transformers does) and summed; Qwen2-MoE adds a dense shared expert scaled by ``sigmoid(gate(x))``.
Family differences are data (``MoEArch``, one per model_type in compress/format/families.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from compress.format.families import MoEArch
from runtime.kernels.moe import ExpertsFn, torch_experts


@dataclass(frozen=True)
class MoEConfig:
    """The MoE shape of one model, read from its transformers ``config.json`` dict."""

    num_experts: int
    top_k: int
    intermediate_size: int  # one expert's width
    renormalize: bool
    fp32_weights: bool
    shared_intermediate_size: int | None  # the shared expert's width, when there is one
    sparse_layers: tuple[int, ...]  # layers whose MLP is the MoE block (the rest are dense)

    @classmethod
    def from_hf(cls, arch: MoEArch, cfg: dict, num_layers: int) -> "MoEConfig":
        # Mixtral says num_local_experts, Qwen/OLMoE num_experts (and transformers writes either for either)
        num_experts, top_k = cfg.get("num_local_experts") or cfg.get("num_experts") or 0, cfg["num_experts_per_tok"]
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be in 1..num_experts={num_experts}")
        layers = range(num_layers)
        if arch.sparse_step:
            step, dense = cfg.get("decoder_sparse_step", 1), set(cfg.get("mlp_only_layers") or ())
            layers = [i for i in layers if i not in dense and (i + 1) % step == 0]
        return cls(num_experts=num_experts, top_k=top_k, intermediate_size=cfg[arch.intermediate_key],
                   renormalize=arch.always_renormalize or bool(cfg.get("norm_topk_prob", False)),
                   fp32_weights=arch.fp32_weights,
                   shared_intermediate_size=cfg["shared_expert_intermediate_size"] if arch.shared_expert else None,
                   sparse_layers=tuple(layers))


class Routing(NamedTuple):
    index: Tensor  # [T, k] expert ids
    weights: Tensor  # [T, k] fp32


def route(logits: Tensor, top_k: int, renormalize: bool) -> Routing:
    """Top-k experts of router logits ``[T, E]``: softmax over all in fp32, top-k, optional renormalization."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, index = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return Routing(index, weights)


class SparseMoE(nn.Module):
    """Router + routed experts (+ the optional shared expert); ``[T, H] -> [T, H]``.

    ``gate_up_proj``/``down_proj`` are stacked experts the loader sets (``StackedLinears`` or packed
    ``PackedLinears``); ``experts_fn`` is the kernel that runs them (the runner picks Triton on CUDA).
    """

    def __init__(self, cfg: MoEConfig, hidden_size: int, act, shared: nn.Module | None = None):
        super().__init__()
        self.cfg, self.act = cfg, act
        self.register_buffer("router", torch.zeros(cfg.num_experts, hidden_size, dtype=torch.float32))  # [E, H]
        self.gate_up_proj: nn.Module = nn.Identity()
        self.down_proj: nn.Module = nn.Identity()
        self.shared_expert = shared
        self.shared_expert_gate: nn.Module | None = nn.Identity() if shared is not None else None  # [T, H] -> [T, 1]
        self.experts_fn: ExpertsFn = torch_experts

    def forward(self, x: Tensor) -> Tensor:
        cfg = self.cfg
        r = route(F.linear(x.float(), self.router), cfg.top_k, cfg.renormalize)
        weights = r.weights if cfg.fp32_weights else r.weights.to(x.dtype)
        out = self.experts_fn(x, r.index, weights, self.gate_up_proj, self.down_proj, self.act)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out
