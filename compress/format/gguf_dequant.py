"""GGUF -> an fp32 safetensors folder, one tensor at a time (so a GGUF larger than RAM converts).

transformers' own GGUF loading dequantizes every tensor into one dict before building the model, which
holds the whole fp32 model (plus the model it builds) at once. Here the same pieces run per tensor: the
config comes from the GGUF metadata (transformers' reader), the GGUF -> Hugging Face name map and the
per-architecture fix-ups (llama's q/k row order, ...) are transformers' ``TensorProcessor``s applied to
a model skeleton on the ``meta`` device, and each dequantized tensor is written to a part file as soon as
it exists; the parts are then regrouped into ``model.safetensors`` or ~2 GB shards (compress/format/shards.py).
Processors that stitch several GGUF tensors into one (per-expert MoE slices) keep their stitched
tensors in memory until the end, as transformers does.
"""
from __future__ import annotations

import logging
import math
from pathlib import Path

import numpy as np
import torch

from compress.format.shards import consolidate, write_shard

log = logging.getLogger(__name__)

MAX_SHARD_BYTES = 2 << 30
PART_BYTES = 256 << 20  # tensors gathered before a part file is written


class _Parts:
    """Tensors written to numbered part files in ``folder`` once about PART_BYTES have gathered."""

    def __init__(self, folder: Path):
        self.folder, self.files, self.pending, self.size, self.names = folder, [], {}, 0, set()

    def add(self, name: str, t: torch.Tensor) -> None:
        self.pending[name] = t
        self.names.add(name)
        self.size += t.numel() * t.element_size()
        if self.size >= PART_BYTES:
            self.flush()

    def flush(self) -> None:
        if self.pending:
            self.files.append(self.folder / f".part-{len(self.files):05d}.safetensors")
            write_shard(self.files[-1], self.pending)
            self.pending, self.size = {}, 0


# GGUF metadata transformers' config reader leaves out (-> config attribute), read when the config has the attribute
SHAPE_KEYS = {"attention.key_length": "head_dim", "expert_feed_forward_length": "moe_intermediate_size",
              "expert_shared_feed_forward_length": "shared_expert_intermediate_size"}


def llama3_rope_from_factors(factors: torch.Tensor, theta: float, original: int = 8192) -> dict:
    """Llama 3.1's rope parameters that reproduce llama.cpp's per-frequency ``rope_freqs`` factors [dim/2].

    Each factor is ``1/f = 1/F + s (1 - 1/F)`` with the blend ``s = a / wavelength + b`` clamped to [0, 1]
    (``a = original / (high - low)``, ``b = -low / (high - low)``): the blended factors fix the line (two or
    more: least squares), and the frequencies left at 1 (s >= 1) and slowed by F (s <= 0) bound it. Only the
    ratios original/low and original/high matter, so ``original`` is free (8192, Llama 3.1's)."""
    f = factors.double()
    dim = 2 * f.numel()
    F = float(f.max())
    x = theta ** -(torch.arange(0, dim, 2, dtype=torch.float64) / dim) / (2 * math.pi)  # 1 / wavelength
    mid = (f > 1 + 1e-6) & (f < F * (1 - 1e-6))
    kept, slowed = x[f <= 1 + 1e-6], x[f >= F * (1 - 1e-6)]
    hi_x = float(kept.min()) if kept.numel() else float(x.max()) * 2  # where s reaches 1
    lo_x = float(slowed.max()) if slowed.numel() else float(x.min()) / 2  # where s falls to 0
    s_mid = (1 / f[mid] - 1 / F) / (1 - 1 / F)
    if int(mid.sum()) >= 2:
        a, b = torch.linalg.lstsq(torch.stack([x[mid], torch.ones_like(s_mid)], 1), s_mid[:, None]).solution[:, 0]
        a, b = float(a), float(b)
    elif int(mid.sum()) == 1:  # through the one blended point, steep enough to reach 1 and 0 by the bounds
        xm, sm = float(x[mid][0]), float(s_mid[0])
        a = max((1 - sm) / (hi_x - xm), sm / (xm - lo_x))
        b = sm - a * xm
    else:  # from 0 at the slowest kept-F frequency to 1 at the fastest-but-one (both exact at those edges)
        a = 1 / (hi_x - lo_x)
        b = -a * lo_x
    span = original / a
    return {"rope_type": "llama3", "rope_theta": theta, "factor": F, "original_max_position_embeddings": original,
            "low_freq_factor": -b * span, "high_freq_factor": (1 - b) * span}


def _rope_from_tensors(config, reader, arch: str) -> None:
    """transformers' GGUF reader drops llama.cpp's ``rope_freqs`` (Llama 3.1/3.2): without it the model loads
    with an unscaled rope. Put the equivalent llama3 rope parameters back into ``config``."""
    tensor = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if tensor is None:
        return
    if arch not in ("llama", "granite"):
        raise ValueError(f"this GGUF's architecture {arch!r} carries rope_freqs, which only llama/granite models "
                         "read as Llama 3.1's rope scaling; converting it would change its rotary embedding")
    params = getattr(config, "rope_parameters", None) or {}
    theta = float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
    factors = torch.from_numpy(np.array(tensor.data, dtype=np.float32))
    config.rope_parameters = llama3_rope_from_factors(factors, theta)
    log.info("rope_freqs read back as llama3 rope parameters %s", config.rope_parameters)


def _skeleton(folder: Path, gguf_file: str, reader, arch: str):
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import read_field

    config = AutoConfig.from_pretrained(folder, gguf_file=gguf_file)
    config.quantization_config = None
    for key, attr in SHAPE_KEYS.items():
        field = f"{arch}.{key}"
        if field in reader.fields and hasattr(config, attr):
            setattr(config, attr, int(read_field(reader, field)[0]))
    _rope_from_tensors(config, reader, arch)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def dequantize_gguf(folder: Path, gguf_file: str, out: Path) -> None:
    """Write ``folder/gguf_file`` dequantized to fp32 into the folder ``out`` (config.json + safetensors)."""
    from gguf import GGUFReader, dequantize
    from transformers.modeling_gguf_pytorch_utils import (TENSOR_PROCESSORS, TensorProcessor,
                                                          get_gguf_hf_weights_map, read_field)

    reader = GGUFReader(folder / gguf_file)
    arch = read_field(reader, "general.architecture")[0]
    model = _skeleton(folder, gguf_file, reader, arch)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=model.config.to_dict())
    names = get_gguf_hf_weights_map(model, processor)
    stitched: dict = {"tensors": {}, "config": model.config.to_dict()}  # what processors fill in themselves
    parts = _Parts(out)
    for tensor in reader.tensors:
        result = processor.process(weights=dequantize(tensor.data, tensor.tensor_type), name=tensor.name,
                                   tensor_key_mapping=names, parsed_parameters=stitched)
        if result.name in names:
            parts.add(names[result.name], _checked(torch.from_numpy(np.array(result.weights, dtype=np.float32)),
                                                   names[result.name], shapes, gguf_file))
    for name, t in stitched["tensors"].items():
        parts.add(name, _checked(t.float().contiguous(), name, shapes, gguf_file))
    parts.flush()
    missing = [k for k in model.state_dict() if k not in parts.names
               and not (k == "lm_head.weight" and model.config.tie_word_embeddings)]
    if missing:
        raise ValueError(f"{gguf_file}: no GGUF tensor for {', '.join(missing[:5])}"
                         + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
    consolidate(parts.files, out, MAX_SHARD_BYTES)
    model.config.save_pretrained(out)
    model.generation_config.save_pretrained(out)


def _checked(t: torch.Tensor, name: str, shapes: dict[str, tuple[int, ...]], gguf_file: str) -> torch.Tensor:
    if shapes.get(name) != tuple(t.shape):
        raise ValueError(f"{gguf_file}: tensor {name} is {tuple(t.shape)} but the config read from its metadata "
                         f"makes it {shapes.get(name)}; this GGUF's architecture is not read fully by transformers")
    return t
