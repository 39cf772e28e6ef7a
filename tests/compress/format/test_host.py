"""compress/format/host.py: freed memory given back to the OS."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from compress.format.host import _malloc_trim, trim

STATUS = Path("/proc/self/status")


def _rss() -> int:
    return int(STATUS.read_text().split("VmRSS:")[1].split()[0]) * 1024


@pytest.mark.skipif(not STATUS.exists() or _malloc_trim() is None, reason="glibc on Linux only")
def test_trim_returns_the_holes_glibc_keeps():
    """The pattern of guided GPTQ's gradient pass: after a 16 MB tensor is freed, glibc raises its mmap threshold,
    so later 4 MB tensors come from its heap, and freeing every other one leaves holes it keeps resident (the pass
    crept up 25 MB a sequence on SmolLM2); trim gives them back."""
    big = torch.ones(4 << 20)
    del big
    keep, drop = [], []
    for i in range(64):
        (keep if i % 2 else drop).append(torch.ones(1 << 20))
    del drop
    before = _rss()
    trim()
    assert before - _rss() > 64 << 20  # 128 MB of holes; most of it comes back
    assert len(keep) == 32
