"""AutoAWQ GEMM (``version: gemm``): the 4-bit layout transformers, vLLM and AutoAWQ read.

Per quantized linear ``P`` (AutoAWQ ``WQLinear_GEMM.from_linear``):
- ``P.qweight``  int32 [in, out / 8]: for each input row, 8 output columns a word, nibble ``i`` holding
  column ``AWQ_ORDER[i]`` of the word's 8 (``[0, 2, 4, 6, 1, 3, 5, 7]``), LSB first.
- ``P.qzeros``   int32 [G, out / 8]: raw zero points (no ``- 1``), packed the same way.
- ``P.scales``   fp16 [G, out], ``G = in / group_size``.
Dequantization: ``w[i, o] = (q[i, o] - z[i // group_size, o]) * scales[i // group_size, o]``.
AWQ kernels always subtract a zero, so symmetric schemes store their implicit ``2**(bits-1)``.
No g_idx (act-order cannot be carried) and no ragged groups (``in % group_size == 0`` is asserted).
A quantized untied LM head is one more layer (``lm_head: true``); a quantized embedding is refused unless
``--dequantize-embedding`` writes it dequantized.
"""
from __future__ import annotations

from pathlib import Path

import torch

from compress.exporters.common import (Source, export_config, fp_linear_names, fp_tensors, is_ragged, save_safetensors,
                                    write_side_files, zeros_of)
from compress.exporters.packing import awq_interleave, dense_pack
from compress.format.qlinear import QuantLinear


def check_embed(_) -> str:
    return "AWQ quantizes linear layers only"


def check(m: QuantLinear) -> str | None:
    s = m.scheme
    if s.format != "int":
        return f"{s.format} codes are not on a uniform integer grid"
    if s.bits != 4:
        return f"{s.bits}-bit: AWQ's GEMM layout is 4-bit only"
    if m.g_idx is not None:
        return "act-order group map (g_idx): AWQ has no g_idx"
    if is_ragged(m):
        return f"ragged groups: AWQ needs group_size {s.group_size} to divide in_features {m.in_features}"
    if m.out_features % 8:
        return f"out_features {m.out_features} is not a multiple of 8"
    return None


def _pack_along_out(x: torch.Tensor) -> torch.Tensor:
    """[rows, out] codes -> int32 [rows, out / 8] in AWQ's nibble order."""
    return dense_pack(awq_interleave(x), 4)


def layer_tensors(name: str, m: QuantLinear) -> dict[str, torch.Tensor]:
    return {f"{name}.qweight": _pack_along_out(m.codes().t().contiguous()),  # [out, in] -> [in, out / 8]
            f"{name}.qzeros": _pack_along_out(zeros_of(m).t().contiguous()),  # [out, G] -> [G, out / 8]
            f"{name}.scales": m.scales.t().contiguous().to(torch.float16)}


def quantization_config(model, qmodules: dict[str, QuantLinear]) -> dict:
    sizes = sorted({m.scheme.group_size for m in qmodules.values()})
    if len(sizes) > 1:
        raise ValueError(f"AWQ's config has one group_size and this model mixes {sizes}; "
                         "use --format gptq or compressed-tensors, which carry per-layer schemes")
    cfg = {"quant_method": "awq", "version": "gemm", "bits": 4, "group_size": sizes[0], "zero_point": True,
           "modules_to_not_convert": fp_linear_names(model) or None}
    if isinstance(model.get_output_embeddings(), QuantLinear):
        cfg["lm_head"] = True  # vLLM's AWQ configs read it (lm_head_quantized); AutoAWQ never quantizes the head
    return cfg


def write(source: Source, folder: Path, dtype: torch.dtype) -> None:
    qc = quantization_config(source.model, source.qmodules)
    tensors = fp_tensors(source.model, dtype, source.tables)
    for name, m in source.qmodules.items():
        tensors.update(layer_tensors(name, m))
    save_safetensors(tensors, folder / "model.safetensors")
    write_side_files(folder, source, export_config(source.model, dtype, qc, source.tables))
