"""Host memory, as the quantizer and the runtime both see it: sizes read and written, what is free, freed pages
given back."""
from __future__ import annotations

import functools
import re

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "M": 1 << 20, "MB": 1 << 20, "G": 1 << 30, "GB": 1 << 30,
          "T": 1 << 40, "TB": 1 << 40, "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40}


def parse_size(text: str) -> int:
    """``"8GB"``, ``"512 MiB"``, ``"1.5G"`` -> bytes (binary units)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).upper() not in _UNITS:
        raise ValueError(f"cannot read memory size {text!r}; write e.g. 8GB, 512MB or 1.5GiB")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def available_bytes() -> int | None:
    """MemAvailable of this machine (Linux), or None where /proc/meminfo is missing."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return None


@functools.cache
def _malloc_trim():
    """glibc's ``malloc_trim``, looked up once (``find_library`` runs ldconfig), or None elsewhere."""
    import ctypes
    import ctypes.util

    try:
        return ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim
    except (OSError, AttributeError, TypeError):  # not glibc
        return None


def trim() -> None:
    """Give freed memory back to the OS. glibc keeps large freed chunks in its heap (its mmap threshold grows
    with the sizes freed), so a loop that allocates and frees big tensors (a block at a time, a weight at a
    time, a sequence's graph at a time) otherwise creeps up in resident memory; elsewhere this does nothing."""
    fn = _malloc_trim()
    if fn is not None:
        fn(0)
