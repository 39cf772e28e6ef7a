"""Calibration activations on disk (``--offload-activations``): one file per batch, memory-mapped back one batch
at a time, so the hidden states of a large calibration set need not fit in memory with the block.

A :class:`DiskTensors` stands where the drivers keep a list of hidden states (compress/calibrate.py
``BlockInputs.hidden``): it is appended to, indexed and iterated like one, and its folder is deleted when it is
dropped. The tensors are stored exactly (same dtype), so offloading changes no result.
"""
from __future__ import annotations

import shutil
import tempfile
import weakref
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor


class DiskTensors(Sequence):
    """Tensors in numbered files under a fresh folder inside ``root``."""

    def __init__(self, root: Path):
        root.mkdir(parents=True, exist_ok=True)
        self.root = root
        self.folder = Path(tempfile.mkdtemp(prefix="activations-", dir=root))
        self.paths: list[Path] = []
        weakref.finalize(self, shutil.rmtree, self.folder, True)

    def append(self, t: Tensor) -> None:
        self.paths.append(self.folder / f"{len(self.paths):05d}.pt")
        torch.save(t.detach().contiguous(), self.paths[-1])

    def __getitem__(self, i: int) -> Tensor:
        return torch.load(self.paths[i], mmap=True, weights_only=True)

    def __len__(self) -> int:
        return len(self.paths)

    def part(self, start: int, stop: int) -> "DiskTensors":
        """A view of the files ``start:stop`` (it keeps this container, whose folder they live in, alive)."""
        view = DiskTensors.__new__(DiskTensors)
        view.root, view.folder, view.paths, view._whole = self.root, self.folder, self.paths[start:stop], self
        return view

    def sibling(self) -> "DiskTensors":
        """An empty container beside this one (a block's outputs, next to its inputs)."""
        return DiskTensors(self.root)


def empty_like(hidden) -> list | DiskTensors:
    """An empty container of the same kind as ``hidden``: on disk if it is, else a list."""
    return hidden.sibling() if isinstance(hidden, DiskTensors) else []
