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


def streamed_and_in_memory(src: Path, cfg, tmp_path: Path):
    """Both quantize runs of ``cfg`` on ``src``; asserts they wrote the very same tensors."""
    from compress.job import quantize_to_folder

    streamed = quantize_to_folder(str(src), cfg, str(tmp_path / "s"), stream=True)
    whole = quantize_to_folder(str(src), cfg, str(tmp_path / "m"), stream=False)
    assert streamed.streamed and not whole.streamed
    a, b = folder_tensors(streamed.out), folder_tensors(whole.out)
    assert a.keys() == b.keys()
    assert [k for k in a if not torch.equal(a[k], b[k])] == []
    return streamed, whole
