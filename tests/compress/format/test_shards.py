"""Safetensors shards written and read a slab at a time: the same bytes safetensors itself reads and writes."""
import errno

import pytest
import torch
from safetensors.torch import load_file, save_file

from compress.format import shards


def test_written_shards_are_safetensors_and_read_back_in_slabs(tmp_path, monkeypatch):
    monkeypatch.setattr(shards, "SLAB_BYTES", 64)  # many slabs per tensor
    big = torch.randn(37, 5).to(torch.bfloat16)
    small = {"a.qweight": torch.randint(-2**31, 2**31 - 1, (3, 4), dtype=torch.int32), "n": torch.tensor(2.5)}
    lazy = shards.Lazy(torch.float32, tuple(big.shape), lambda: (s.float() for s in big.split(4)))
    shards.write_shard(tmp_path / "x.safetensors", {**small, "big": lazy})
    back = load_file(str(tmp_path / "x.safetensors"))
    assert torch.equal(back["big"], big.float()) and all(torch.equal(back[k], v) for k, v in small.items())

    save_file({"e": big, "z": torch.arange(6, dtype=torch.int64)}, str(tmp_path / "y.safetensors"))
    reader = shards.ShardReader(tmp_path)
    assert torch.equal(torch.cat(list(reader.slabs("e", torch.float32))), big.float())
    assert torch.equal(reader.rows("e", 3, 9), big[3:9]) and torch.equal(reader.get("z"), torch.arange(6))


def test_consolidate_groups_parts_by_size(tmp_path):
    parts = []
    for i in range(4):
        parts.append(tmp_path / f".part-{i}.safetensors")
        shards.write_shard(parts[-1], {f"t{i}": torch.full((256,), float(i))})
    shards.consolidate(parts, tmp_path, max_shard_bytes=2500)  # two 1 KiB tensors per shard
    names = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert names == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    reader = shards.ShardReader(tmp_path)  # through the index
    assert [reader.get(f"t{i}")[0].item() for i in range(4)] == [0.0, 1.0, 2.0, 3.0]


def test_a_full_disk_is_named(tmp_path, monkeypatch):
    class Full:
        def __init__(self, *a):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *a):
            return False

        def write(self, b):
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("builtins.open", Full)
    with pytest.raises(OSError, match="disk full while writing x.safetensors"):
        shards.write_shard(tmp_path / "x.safetensors", {"t": torch.zeros(4)})
