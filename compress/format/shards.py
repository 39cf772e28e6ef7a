"""Safetensors shards read and written a tensor (or a slab of rows) at a time, in bounded memory.

The format is an 8-byte little-endian header length, a JSON header ``{name: {"dtype", "shape",
"data_offsets": [begin, end]}, "__metadata__": {...}}`` and the raw bytes. Reading goes through
plain file reads (not a memory map), so copying a large tensor from a source shard to an output
shard, cast row slab by row slab, never holds the tensor and never grows the resident set by the
page cache. A folder's shards are listed by ``model.safetensors.index.json`` when it has one.
"""
from __future__ import annotations

import errno
import json
import math
import struct
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}
NAMES = {v: k for k, v in DTYPES.items()}
INDEX = "model.safetensors.index.json"
SLAB_BYTES = 32 << 20  # rows read (and cast) per step when copying a large tensor


@dataclass(frozen=True)
class Entry:
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # absolute byte offset of the data in ``file``
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


def read_header(path: Path) -> dict[str, Entry]:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    out = {}
    for name, h in header.items():
        if name == "__metadata__":
            continue
        if h["dtype"] not in DTYPES:
            raise ValueError(f"{path}: tensor {name} has dtype {h['dtype']}, which compress does not read")
        begin, end = h["data_offsets"]
        out[name] = Entry(path, DTYPES[h["dtype"]], tuple(h["shape"]), 8 + n + begin, 8 + n + end)
    return out


def shard_files(folder: Path) -> list[Path]:
    """The folder's safetensors files: those its index names, else every ``*.safetensors``."""
    index = folder / INDEX
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / f for f in files]
    return sorted(folder.glob("*.safetensors"))


class ShardReader:
    """Every tensor of a folder's safetensors shards, by name; nothing is read until asked."""

    def __init__(self, folder: str | Path, files: list[Path] | None = None):
        self.folder = Path(folder)
        files = shard_files(self.folder) if files is None else files
        if not files:
            raise FileNotFoundError(f"{self.folder} holds no *.safetensors weights")
        self.entries: dict[str, Entry] = {}
        for f in files:
            self.entries.update(read_header(f))

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def keys(self) -> list[str]:
        return list(self.entries)

    def rows(self, name: str, start: int, stop: int) -> Tensor:
        """Rows ``start:stop`` (along dim 0) of one tensor, read from disk in its stored dtype."""
        e = self.entries[name]
        row = e.nbytes // max(e.shape[0], 1) if e.shape else e.nbytes
        buf = bytearray((stop - start) * row)
        with open(e.file, "rb") as f:
            f.seek(e.begin + start * row)
            if f.readinto(buf) != len(buf):
                raise OSError(f"{e.file} ends inside tensor {name}: the shard is truncated")
        t = torch.frombuffer(buf, dtype=e.dtype) if buf else torch.empty(0, dtype=e.dtype)
        return t.reshape(stop - start, *e.shape[1:]) if e.shape else t.reshape(())

    def get(self, name: str, dtype: torch.dtype | None = None) -> Tensor:
        e = self.entries[name]
        t = self.rows(name, 0, e.shape[0]) if e.shape else self.rows(name, 0, 1)
        return t if dtype is None else t.to(dtype)

    def slabs(self, name: str, dtype: torch.dtype) -> Iterator[Tensor]:
        """The tensor as consecutive row slabs of about ``SLAB_BYTES``, cast to ``dtype``."""
        e = self.entries[name]
        if not e.shape:
            yield self.get(name, dtype)
            return
        step = max(1, SLAB_BYTES // max(1, e.nbytes // max(e.shape[0], 1)))
        for start in range(0, e.shape[0], step):
            yield self.rows(name, start, min(start + step, e.shape[0])).to(dtype)


@dataclass(frozen=True)
class Lazy:
    """A tensor written without being held: its dtype and shape, and its bytes as slabs."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    slabs: Callable[[], Iterable[Tensor]]


def _nbytes(t: Tensor | Lazy) -> int:
    return math.prod(t.shape) * (t.element_size() if isinstance(t, Tensor) else torch.empty(0, dtype=t.dtype).element_size())


def write_shard(path: Path, tensors: dict[str, Tensor | Lazy], metadata: dict[str, str] | None = None) -> int:
    """Write one safetensors file from tensors and lazy tensors; returns its size. A full disk is named."""
    header: dict = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    for name, t in tensors.items():
        n = _nbytes(t)
        header[name] = {"dtype": NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    try:
        with open(path, "wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw)
            for name, t in tensors.items():
                for slab in ([t] if isinstance(t, Tensor) else t.slabs()):
                    f.write(memoryview(slab.detach().contiguous().reshape(-1).view(torch.uint8).numpy()))
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise OSError(e.errno, f"disk full while writing {path.name} ({offset / 2**30:.2f} GiB) in "
                                   f"{path.parent}: free space there or give --out on a larger disk") from e
        raise
    return 8 + len(raw) + offset


def write_index(folder: Path, weight_map: dict[str, str], total_size: int) -> None:
    index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
    (folder / INDEX).write_text(json.dumps(index, indent=2))


def shard_name(i: int, n: int) -> str:
    return f"model-{i:05d}-of-{n:05d}.safetensors"


def consolidate(parts: list[Path], folder: Path, max_shard_bytes: int) -> None:
    """Rewrite ``parts`` (in order) as ``model.safetensors``, or as shards of at most about
    ``max_shard_bytes`` with an index, copying slab by slab; the parts are deleted as they are copied."""
    groups: list[list[Path]] = [[]]
    size = 0
    for p in parts:
        n = p.stat().st_size
        if groups[-1] and size + n > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(p)
        size += n
    names = ["model.safetensors"] if len(groups) == 1 else [shard_name(i + 1, len(groups)) for i in range(len(groups))]
    weight_map, total = {}, 0
    for name, group in zip(names, groups):
        tensors: dict[str, Tensor | Lazy] = {}
        for p in group:
            reader = ShardReader(p.parent, [p])
            for key, e in reader.entries.items():
                tensors[key] = Lazy(e.dtype, e.shape, lambda reader=reader, key=key, e=e: reader.slabs(key, e.dtype))
        total += write_shard(folder / name, tensors)
        weight_map.update({k: name for k in tensors})
        for p in group:
            p.unlink()
    if len(groups) > 1:
        write_index(folder, weight_map, total)


