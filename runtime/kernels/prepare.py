"""Every quantized linear of a model swapped for its kernel module (runtime/kernels/qmatmul.py), the tied head
first (runtime/kernels/lm_head.py): the one place that needs both."""
from __future__ import annotations

import logging
from collections import Counter

import torch
from torch import nn

from compress.format.host import trim
from compress.format.qlinear import QuantLinear
from runtime.kernels import w8a8
from runtime.kernels.lm_head import prepare_tied_head
from runtime.kernels.qmatmul import PACKED_MODES, TritonLinear, prepare_linear

log = logging.getLogger(__name__)


def prepare_model(model: nn.Module, mode: str, dtype: torch.dtype, device_type: str = "cpu",
                  fused: bool = False, lean: bool = False) -> dict[str, int]:
    """Replace every QuantLinear in ``model`` by its kernel module; returns how many took each path. ``lean``
    (a model too large for copies of its weights, :func:`too_large_for_copies`) runs "auto"/"hybrid" as "packed".
    A tied quantized head is converted first, its tiles built in place of the embedding's codes, which the
    embedding then reads (runtime/kernels/lm_head.py): the codes are held once, and the conversion's temporaries
    come before the blocks' weights are added to the peak."""
    counts: Counter[str] = Counter()
    mode = "packed" if lean and mode in ("auto", "hybrid") else mode
    scratch = w8a8.Scratch()  # one for the whole model: its linears run one at a time
    names = [n for n, m in model.named_modules() if isinstance(m, QuantLinear)]  # names only: each replaced
    names.sort(key=lambda n: n != "lm_head")                                     # QuantLinear is freed at once
    for name in names:
        module = model.get_submodule(name)
        if device_type == "cuda" and mode in PACKED_MODES:
            kernel = TritonLinear(module)
        elif name == "lm_head":  # from its codes only, "hybrid" too (as before): a bf16 copy is a [vocab, hidden] table
            kernel = prepare_tied_head(model, module, "packed" if mode in PACKED_MODES else mode, dtype, fused, lean)
        else:
            kernel = prepare_linear(module, mode, dtype, fused, lean, scratch)
        del module
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, kernel)
        counts[kernel.path] += 1
        trim()  # the conversion's temporaries, returned weight by weight (glibc keeps freed chunks otherwise)
    if counts:
        log.info("quantized linears: %s", dict(counts))
    return dict(counts)
