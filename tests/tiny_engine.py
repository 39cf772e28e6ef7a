"""Helpers for engine tests: tiny random HF models saved to a folder, and transformers' greedy reference."""
from __future__ import annotations

import torch

from tiny_models import tiny_config


def save_tiny(family, path, tokenizer=None, seed: int = 0, weight_std: float = 0.15, overrides: dict | None = None,
              **kw):
    """A tiny random model of ``family`` (a tests/tiny_models.py name, or a transformers config built by the test)
    saved with ``save_pretrained`` (plus tokenizer); returns the model.

    Linear weights get a larger spread than the default init so greedy outputs vary from step to step
    (with std 0.02 most families just repeat a prompt token, which would make parity tests weak).
    """
    from transformers import AutoModelForCausalLM

    if tokenizer is not None:
        kw.setdefault("vocab", len(tokenizer))
    config = tiny_config(family, **kw) if isinstance(family, str) else family
    for k, v in (overrides or {}).items():
        setattr(config, k, v)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2 and "embed" not in name:  # linears, and fused 3D experts of MoE models
                p.copy_(torch.randn(p.shape, generator=g) * weight_std)
            elif "norm" in name:  # away from 1 (or 0 for Gemma's 1 + w), so a wrong norm form shows
                p.add_(torch.randn(p.shape, generator=g) * 0.1)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = None
    model.save_pretrained(path)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return model


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def prompts(vocab: int, lengths=(5, 16, 21, 1, 40), seed: int = 0) -> list[list[int]]:
    """Token-id prompts of the given lengths (ending mid-block, on a block edge, a single token...)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def rtn4_folder(hf, path) -> None:
    """``hf`` with every linear but the head replaced by its rtn4 QuantLinear (in place), saved as compress does."""
    from compress.format.checkpoint import build_quantization_config, save_quantized, set_module
    from compress.format.qlinear import QuantLinear
    from compress.format.quant import Scheme, quantize_weight

    scheme = Scheme(bits=4, group_size=32, sym=False)
    for name, mod in list(hf.named_modules()):
        if isinstance(mod, torch.nn.Linear) and name != "lm_head":
            set_module(hf, name, QuantLinear.from_quantized(quantize_weight(mod.weight.data, scheme), bias=mod.bias))
    save_quantized(hf, None, path, build_quantization_config(hf, "rtn", scheme))
