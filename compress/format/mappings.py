"""AWQ's view of the family table: which op feeds which linears inside a decoder block, per model_type.

AWQ folds a per-input-channel scale ``s`` into the op before a group of linears (a norm's weight, or
the rows of a preceding linear) and multiplies the linears' columns by ``s``. Names are relative to
one decoder block. ``inspect`` names the submodule whose output measures the error of a scale
(``None``: the concatenated outputs of the linears themselves). The maps themselves live in
compress/format/families.py with the rest of each family's knowledge.
"""
from __future__ import annotations

from compress.format.families import BlockMap, Residual, Smooth, require  # noqa: F401  (the types steps use)

# Linears that always stay in full precision: the output head and MoE routers.
KEEP_FP = (r"(^|\.)lm_head$", r"\.gate$", r"shared_expert_gate$", r"\.router$")


def block_map(model_type: str) -> BlockMap:
    return require(model_type, "awq", "rtn, gptq, nf4 and int8 need no smoothing map").smooth
