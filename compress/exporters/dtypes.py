"""The float dtype of an export's unquantized tensors: the model's own by default, float16 only where it is safe.

``--dtype`` takes float32, float16 or bfloat16 where the format's runtime computes in it. Left out, an export
writes the dtype the model is published in (compress/format/models.py ``declared_dtype``; bfloat16 for Gemma and most
current models), or the format's own default where its runtime cannot use that dtype (ONNX Runtime's CPU kernels
have no bfloat16 MatMul: float32 there) or none is known (a GGUF source: bfloat16, float32's range at half the
size). float16 keeps 5 exponent bits (max 65504) and some families' activations exceed that (Gemma 2/3's
residual stream): before float16 is written, a float16 forward of a few tokens must stay finite, or the export
is refused naming the dtype that has float32's range.
"""
from __future__ import annotations

import copy
import logging

import torch
from torch import nn

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
NAMES = {v: k for k, v in DTYPES.items()}
PROBE = "The quick brown fox jumps over the lazy dog. 1, 2, 3, 4: Paris, Tokyo, Lima."


def choose(fmt: str, requested: str | None, declared: torch.dtype | None, allowed: tuple[str, ...],
           fallback: str) -> str:
    """The dtype name to write: ``requested`` if ``fmt`` takes it, else the model's ``declared`` dtype where
    ``fmt`` takes it, else ``fallback``."""
    if requested is not None:
        if requested not in DTYPES:
            raise ValueError(f"--dtype {requested!r} is not a dtype; use one of: {', '.join(DTYPES)}")
        if requested not in allowed:
            why = (" (ONNX Runtime's CPU kernels have no bfloat16 MatMul)" if requested == "bfloat16"
                   and fmt.startswith("onnx") else "")
            raise ValueError(f"--format {fmt} does not take --dtype {requested}{why}; use one of: {', '.join(allowed)}")
        return requested
    own = NAMES.get(declared)
    return own if own in allowed else fallback


def probe_ids(tokenizer, vocab_size: int, n: int = 16) -> torch.Tensor:
    """A few real tokens (BOS first, where activations peak in most LLMs), or the first ids without a tokenizer."""
    if tokenizer is not None:
        ids = tokenizer(PROBE, return_tensors="pt").input_ids[:, :n]
        bos = getattr(tokenizer, "bos_token_id", None)
        if bos is not None and ids.shape[1] and int(ids[0, 0]) != bos:
            ids = torch.cat([torch.tensor([[bos]]), ids[:, : n - 1]], dim=1)
        if ids.shape[1] and int(ids.max()) < vocab_size:
            return ids
    return (torch.arange(n) % vocab_size)[None]


@torch.no_grad()
def first_overflow(model: nn.Module, ids: torch.Tensor) -> str | None:
    """Run ``model`` (already in float16) on ``ids``; the first module whose output is not finite, or None."""
    bad: list[str] = []

    def hook(name):
        def fn(module, args, out):
            t = out[0] if isinstance(out, tuple) else out
            if not bad and isinstance(t, torch.Tensor) and t.is_floating_point() and not torch.isfinite(t).all():
                bad.append(name)
        return fn

    handles = [m.register_forward_hook(hook(n)) for n, m in model.named_modules() if n]
    try:
        logits = model(ids).logits
    finally:
        for h in handles:
            h.remove()
    if not bad and not torch.isfinite(logits).all():
        bad.append("the logits")
    return bad[0] if bad else None


def require_fp16_safe(model: nn.Module, tokenizer, fmt: str, instead: str) -> None:
    """Refuse float16 when a float16 copy of ``model`` overflows on a few tokens (the fp model itself finite)."""
    half = copy.deepcopy(model).to(torch.float16).eval()
    ids = probe_ids(tokenizer, model.config.vocab_size)
    where = first_overflow(half, ids)
    del half
    if where is None:
        return
    with torch.no_grad():
        finite = bool(torch.isfinite(model(ids).logits).all())
    if not finite:
        log.warning("the model's own logits are not finite on the probe tokens; not blaming float16")
        return
    raise ValueError(f"--format {fmt} --dtype float16: this model overflows float16 (max 65504): {where} is inf/NaN "
                     f"in a float16 forward of {ids.shape[1]} tokens, so the export would produce garbage; "
                     f"use --dtype {instead}")
