"""Tiny model folders on disk and the tensors a quantized folder holds (the stream, embedding/head and head GPTQ
tests share them)."""
from pathlib import Path

import torch
from safetensors.torch import load_file
from tiny_models import tiny_model

from compress.format.shards import shard_files


def folder_tensors(folder) -> dict[str, torch.Tensor]:
    out = {}
    for f in shard_files(Path(folder)):
        out.update(load_file(str(f)))
    return out


def save_tiny(tmp_path, family, tokenizer, **kw) -> Path:
    path = tmp_path / family
    tiny_model(family, **{"vocab": len(tokenizer), **kw}).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
