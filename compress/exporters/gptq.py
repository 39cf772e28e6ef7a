"""GPTQ (``checkpoint_format: gptq`` or ``gptq_v2``): the layout AutoGPTQ wrote and GPTQModel, transformers and
vLLM read.

Per quantized linear ``P`` (AutoGPTQ ``qlinear_cuda_old.QuantLinear.pack``):
- ``P.qweight``  int32 [in * bits / 32, out]: for each output column, the codes of its ``in`` inputs
  as one LSB-first bit stream (8 codes a word at 4 bits; at 3 bits 32 codes fill 3 words, straddling).
- ``P.qzeros``   int32 [G, out * bits / 32]: per group, the zero of each output packed the same way along
  ``out``: v1 stores ``zero - 1`` (readers add the 1 back), v2 the zero itself. Symmetric schemes store
  ``2**(bits-1)`` (minus 1 in v1).
- ``P.scales``   fp16 [G, out], ``G = ceil(in / group_size)`` (a ragged last group is fine).
- ``P.g_idx``    int32 [in]: the group of each input column (natural ``i // group_size`` or act-order's map).
Dequantization: ``w[i, o] = scales[g_idx[i], o] * (q[i, o] - (qzeros[g_idx[i], o] + offset))``, offset 1 in v1, 0 in v2.

A zero point of 0 cannot be stored in v1 (``0 - 1`` wraps), which asymmetric min/max rounding gives any group whose
weights are all >= 0 (most layers of a real model have one), so such a model is written as ``gptq_v2`` (exact
zeros): GPTQModel reads it, vLLM reads it since vllm-project/vllm#26092 (its ``gptq_gemm`` kernel; the field is
``checkpoint_format`` in ``quantize_config.json``), and transformers through gptqmodel (``GPTQConfig``'s
``checkpoint_format``); AutoGPTQ and older vLLM read only v1. Every other model stays v1, which every reader takes.
An untied quantized LM head is one more quantized layer (``lm_head: true``, as GPTQModel writes it); a quantized
embedding has no GPTQ form: refused unless ``--dequantize-embedding`` writes it dequantized in the export dtype.
"""
from __future__ import annotations

from collections import Counter
from pathlib import Path

import torch

from compress.exporters.common import (Source, export_config, fp_linear_names, fp_tensors, group_map, save_safetensors,
                                    write_side_files, zeros_of)
from compress.exporters.packing import dense_pack
from compress.format.qlinear import QuantLinear
from compress.format.quant import Scheme

BITS = (2, 3, 4, 8)


def _multiple(bits: int) -> int:
    """The smallest width whose codes fill whole int32 words."""
    return 32 if bits == 3 else 32 // bits


def check_embed(_) -> str:
    return "GPTQ quantizes linear layers only"


def check(m: QuantLinear) -> str | None:
    s = m.scheme
    if s.format != "int":
        return f"{s.format} codes are not on a uniform integer grid"
    if s.bits not in BITS:
        return f"{s.bits}-bit is not a GPTQ width"
    k = _multiple(s.bits)
    if m.in_features % k or m.out_features % k:
        return f"{s.bits}-bit GPTQ packs whole words: in/out features ({m.in_features}, {m.out_features}) must be multiples of {k}"
    return None


def checkpoint_format(qmodules: dict[str, QuantLinear]) -> str:
    """``gptq`` (v1, every reader) unless a zero point of 0 needs ``gptq_v2``'s exact zeros."""
    v1 = all(m.qzeros is None or bool((m.qzeros >= 1).all()) for m in qmodules.values())
    return "gptq" if v1 else "gptq_v2"


def layer_tensors(name: str, m: QuantLinear, fmt: str = "gptq") -> dict[str, torch.Tensor]:
    bits = m.scheme.bits
    # codes: [out, in] -> stream along in -> [out, in * bits / 32] -> [in * bits / 32, out]
    qweight = dense_pack(m.codes(), bits).t().contiguous()
    # zeros (v1: minus 1): [out, G] -> [G, out] -> stream along out -> [G, out * bits / 32]
    qzeros = dense_pack((zeros_of(m) - int(fmt == "gptq")).t().contiguous(), bits)
    return {f"{name}.qweight": qweight, f"{name}.qzeros": qzeros,
            f"{name}.scales": m.scales.t().contiguous().to(torch.float16),
            f"{name}.g_idx": group_map(m).to(torch.int32)}


def _scheme_entry(s: Scheme) -> dict:
    return {"bits": s.bits, "group_size": s.group_size, "sym": s.sym}


def quantization_config(model, qmodules: dict[str, QuantLinear]) -> dict:
    """quant_method gptq; layers that differ from the common scheme go in GPTQModel/vLLM's ``dynamic``."""
    base = Counter(m.scheme for m in qmodules.values()).most_common(1)[0][0]
    dynamic = {f"+:^{name.replace('.', '[.]')}$": _scheme_entry(m.scheme)
               for name, m in qmodules.items() if m.scheme != base}
    head = model.get_output_embeddings()
    layer_fp = [n for n in fp_linear_names(model) if model.get_submodule(n) is not head]
    dynamic.update({f"-:^{n.replace('.', '[.]')}$": {} for n in layer_fp})
    cfg = {"quant_method": "gptq", "checkpoint_format": checkpoint_format(qmodules), **_scheme_entry(base),
           "desc_act": any(m.g_idx is not None for m in qmodules.values()),
           "static_groups": False, "true_sequential": True, "damp_percent": 0.01,
           "lm_head": isinstance(head, QuantLinear), "meta": {"quantizer": ["compress"]}}
    if dynamic:
        cfg["dynamic"] = dynamic
    return cfg


def write(source: Source, folder: Path, dtype: torch.dtype) -> None:
    import json

    tensors = fp_tensors(source.model, dtype, source.tables)
    qc = quantization_config(source.model, source.qmodules)
    for name, m in source.qmodules.items():
        tensors.update(layer_tensors(name, m, qc["checkpoint_format"]))
    save_safetensors(tensors, folder / "model.safetensors")
    write_side_files(folder, source, export_config(source.model, dtype, qc, source.tables))
    (folder / "quantize_config.json").write_text(json.dumps(qc, indent=2, sort_keys=True))
