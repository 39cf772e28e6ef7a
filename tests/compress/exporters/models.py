"""Tiny random quantized models built in the tests (no downloads): families x schemes x act-order."""
from __future__ import annotations

import torch
from torch import nn

from compress.format.checkpoint import build_quantization_config, save_quantized, set_module
from compress.format.qlinear import QuantLinear
from compress.format.quant import Scheme, quantize_weight
from tiny_models import byte_tokenizer  # noqa: F401  (the export tests' tokenizer)

# hidden 72: a group of 32 leaves a ragged last group of 8; intermediate 128 divides
FAMILIES = {
    "llama": ("LlamaConfig", {}),
    "qwen2": ("Qwen2Config", {}),
    "mistral": ("MistralConfig", {"sliding_window": None}),
    "gemma": ("GemmaConfig", {"head_dim": 16}),
}


def tiny_config(family: str, hidden: int = 64, vocab: int = 256):
    import transformers

    cls, extra = FAMILIES[family]
    return getattr(transformers, cls)(hidden_size=hidden, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab,
                                      max_position_embeddings=256, **extra)


def tiny_model(family: str, hidden: int = 64, seed: int = 0) -> nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, hidden), dtype=torch.float32)
    with torch.no_grad():  # random init is tiny; widen it so quantization and greedy decoding are non-trivial
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
    return model.eval()


def act_order_map(in_features: int, scheme: Scheme, gen: torch.Generator) -> torch.Tensor:
    """A permutation-derived group map: groups of natural size, columns scattered."""
    natural = torch.arange(in_features) // scheme.group(in_features)
    return natural[torch.randperm(in_features, generator=gen)]


def quantize_model(model: nn.Module, scheme: Scheme, act_order: bool = False, seed: int = 0,
                   skip: tuple[str, ...] = ("lm_head",)) -> nn.Module:
    """RTN every nn.Linear except ``skip`` into QuantLinear (act-order: a random g_idx with its own qparams)."""
    from compress.format.quant import QuantizedWeight
    from compress.format.quant import compute_qparams, quantize

    gen = torch.Generator().manual_seed(seed)
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n.split(".")[-1] not in skip]
    for name in names:
        lin = model.get_submodule(name)
        w = lin.weight.data
        if act_order:
            g_idx = act_order_map(w.shape[1], scheme, gen)
            perm = torch.argsort(g_idx, stable=True)  # quantize in group order, store in natural order
            scale, zero = compute_qparams(w[:, perm], scheme)
            qw = QuantizedWeight(quantize(w, scale, zero, scheme, g_idx), scale, zero, scheme, g_idx)
        else:
            qw = quantize_weight(w, scheme)
        set_module(model, name, QuantLinear.from_quantized(qw, lin.bias))
    return model


def save(model: nn.Module, folder, scheme: Scheme, act_order: bool = False, tokenizer=None):
    """Save as compress quantize would (a tokenizer is needed: compress.format.models.load_model reads one)."""
    qc = build_quantization_config(model, "rtn", scheme, act_order)
    return save_quantized(model, tokenizer or byte_tokenizer(), folder, qc)
