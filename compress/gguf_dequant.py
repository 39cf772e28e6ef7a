"""GGUF -> an fp32 safetensors folder, one tensor at a time (so a GGUF larger than RAM converts).

transformers' own GGUF loading dequantizes every tensor into one dict before building the model, which
holds the whole fp32 model (plus the model it builds) at once. Here the same pieces run per tensor: the
config comes from the GGUF metadata (transformers' reader), the GGUF -> Hugging Face name map and the
per-architecture fix-ups (llama's q/k row order, ...) are transformers' ``TensorProcessor``s applied to
a model skeleton on the ``meta`` device, and each dequantized tensor is written to a part file as soon as
it exists; the parts are then regrouped into ``model.safetensors`` or ~2 GB shards (compress/shards.py).
Processors that stitch several GGUF tensors into one (per-expert MoE slices) keep their stitched
tensors in memory until the end, as transformers does.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from compress.shards import consolidate, write_shard

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


def _skeleton(folder: Path, gguf_file: str, reader, arch: str):
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import read_field

    config = AutoConfig.from_pretrained(folder, gguf_file=gguf_file)
    config.quantization_config = None
    for key, attr in SHAPE_KEYS.items():
        field = f"{arch}.{key}"
        if field in reader.fields and hasattr(config, attr):
            setattr(config, attr, int(read_field(reader, field)[0]))
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
