"""compressed-tensors ``pack-quantized``: the int-weight format vLLM and transformers load natively.

Per quantized linear ``P`` (conventions of compressed_tensors.compressors.pack_quantized):
- ``P.weight_packed``  int32 [out, ceil(in * bits / 32)]: codes packed along ``in``, LSB first. The
  library stores signed ints ``q - 2**(bits-1)`` and packs them offset by ``2**(bits-1)``, so the
  packed bits are our unsigned codes unchanged (this equals QuantLinear.qweight for 2/4/8 bits).
- ``P.weight_scale``  [out, G] (``[out, 1]`` per channel), the fp16 scales, stored in the export dtype.
- ``P.weight_zero_point``  int32 [ceil(out * bits / 32), G], asymmetric only: signed zero
  ``z - 2**(bits-1)`` packed along ``out`` the same way (so again our unsigned zeros' bits).
- ``P.weight_shape``  int64 [2] = (out, in).
Dequantization there: ``(q_signed - zp_signed) * scale == (q - z) * scale``.

A quantized untied LM head is one more quantized layer, named in its config group's targets: vLLM loads it since
vllm-project/vllm#37291 (compressed-tensors' ``get_quant_method`` handles ParallelLMHead; older vLLM loads it
unquantized and fails), transformers through the library. A quantized embedding has no compressed-tensors form
(vLLM's embedding takes no quantization scheme): the export refuses it unless ``--dequantize-embedding`` asks for
it written dequantized in the export dtype (the checkpoint's values at full width, which vLLM loads); ``--embed
none`` at quantize time keeps the original embedding instead.

Not carried (see :func:`check`): act-order group maps (compressed-tensors removed ``actorder: group``),
ragged groups (its group code requires ``in % group_size == 0``), NF4 (not an int grid), and 3 bits
(its 3-bit packing changed between library versions and vLLM has no 3-bit kernel).
"""
from __future__ import annotations

import re
from pathlib import Path

import torch

from compress.exporters.common import (Source, export_config, fp_linear_names, fp_tensors, is_ragged,
                                    save_safetensors, write_side_files)
from compress.format.qlinear import QuantLinear
from compress.format.quant import Scheme, pack

FORMAT = "pack-quantized"
BITS = (2, 4, 8)


def check_embed(_) -> str:
    return "vLLM's embedding takes no quantization scheme, so compressed-tensors has no form for it"


def check(m: QuantLinear) -> str | None:
    s = m.scheme
    if s.format != "int":
        return f"{s.format} codes are not on a uniform integer grid"
    if s.bits not in BITS:
        return f"{s.bits}-bit packing differs between compressed-tensors versions and vLLM has no kernel for it"
    if m.g_idx is not None:
        return "act-order group map (g_idx): compressed-tensors no longer supports actorder='group'"
    if is_ragged(m):
        return (f"ragged groups: group_size {s.group_size} does not divide in_features {m.in_features}, "
                "which compressed-tensors requires")
    return None


def weights_args(s: Scheme) -> dict:
    """The ``weights`` QuantizationArgs of a config group, as compressed-tensors serializes them."""
    channel = s.group_size == -1
    return {"num_bits": s.bits, "type": "int", "symmetric": s.sym, "strategy": "channel" if channel else "group",
            "group_size": None if channel else s.group_size, "dynamic": False, "observer": "minmax"}


def quantization_config(model, qmodules: dict[str, QuantLinear]) -> dict:
    schemes: dict[Scheme, list[str]] = {}
    for name, m in qmodules.items():
        schemes.setdefault(m.scheme, []).append(name)
    head = next((n for n, m in model.named_modules() if m is model.get_output_embeddings()), None)
    groups = {}
    for i, (scheme, names) in enumerate(schemes.items()):
        # one scheme: every Linear not ignored, and a quantized head by name (vLLM's ParallelLMHead is no Linear);
        # several: exact names, so nothing is matched twice
        targets = ["Linear"] + [f"re:^{re.escape(n)}$" for n in names if n == head] if len(schemes) == 1 else \
            [f"re:^{re.escape(n)}$" for n in names]
        groups[f"group_{i}"] = {"targets": targets, "weights": weights_args(scheme), "input_activations": None,
                                "output_activations": None, "format": FORMAT}
    return {"quant_method": "compressed-tensors", "format": FORMAT, "quantization_status": "compressed",
            "config_groups": groups, "ignore": fp_linear_names(model), "kv_cache_scheme": None,
            "sparsity_config": {}, "global_compression_ratio": None}


def layer_tensors(name: str, m: QuantLinear, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    bits = m.scheme.bits
    out = {
        f"{name}.weight_packed": m.qweight.clone(),  # compress/format/quant.py's packing is exactly this for 2/4/8 bits
        f"{name}.weight_scale": m.scales.to(dtype),
        f"{name}.weight_shape": torch.tensor([m.out_features, m.in_features], dtype=torch.int64),
    }
    if m.qzeros is not None:
        # z: [out, G] packed along out -> [ceil(out * bits / 32), G]
        out[f"{name}.weight_zero_point"] = pack(m.qzeros.t(), bits).t()
    return out


def write(source: Source, folder: Path, dtype: torch.dtype) -> None:
    tensors = fp_tensors(source.model, dtype, source.tables)
    for name, m in source.qmodules.items():
        tensors.update(layer_tensors(name, m, dtype))
    save_safetensors(tensors, folder / "model.safetensors")
    qc = quantization_config(source.model, source.qmodules)
    write_side_files(folder, source, export_config(source.model, dtype, qc, source.tables))
