"""The packed weights a decode step streams, held in transparent huge pages.

Batch-1 decode reads every weight byte once a token, so it runs at the speed memory streams. Through 4 KiB pages a
stream of a few hundred MiB misses the TLB every 4 KiB and walks the page tables; through 2 MiB pages it does so 512
times less often. Linux gives anonymous memory huge pages on its own only when ``/sys/kernel/mm/transparent_hugepage
/enabled`` says ``always``; the common ``madvise`` asks for ``madvise(MADV_HUGEPAGE)`` before the pages are first
touched, which torch's allocator does not do (its ``THP_MEM_ALLOC_ENABLE`` is off by default). Measured here (AMD EPYC,
2 threads, the int8 head of a 151,936 x 896 table alone, both copies in one process, alternating): 1.26-1.55x faster
in huge pages (BENCHMARKS.md has the engine's figures).

:func:`move_weights` copies the W8A8 kernels' tiles and group scales (runtime/kernels/w8a8.py) into one anonymous
mapping advised for huge pages, a module at a time (each module's old buffers are freed as it takes the copies, so the
peak grows by one module's, not by the model's), and rebinds the modules to the copies. The bytes are the same; only
where they live changes. Where the kernel has no transparent huge pages (``never``, or not Linux) nothing moves.
torch's int4pack linears (the path without VNNI) stay: their kernel is bound by its arithmetic, not by the pages
(1.01x measured).
"""
from __future__ import annotations

import logging
import mmap
from pathlib import Path

import torch
from torch import Tensor, nn

log = logging.getLogger(__name__)

THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")
ALIGN = 64  # each tensor's offset in the arena: a cache line (the kernels' unaligned loads never split one)


def thp_mode(path: Path = THP_ENABLED) -> str:
    """The kernel's transparent huge page mode, the bracketed word of ``path`` (``always``, ``madvise``, ``never``),
    or "" where there is no such file (not Linux, or a kernel without them)."""
    try:
        text = path.read_text()
    except OSError:
        return ""
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else ""


def arena(nbytes: int, huge: bool = True) -> Tensor:
    """A zeroed uint8 tensor of ``nbytes`` in its own anonymous private mapping, whose pages the OS commits as they are
    first written; ``huge``: advised for huge pages where the kernel takes the advice (2 MiB pages as they are first
    written). The tensor keeps the mapping alive. Without ``mmap``'s anonymous maps (not POSIX): ``torch.zeros``."""
    if not hasattr(mmap, "MAP_ANONYMOUS"):
        return torch.zeros(nbytes, dtype=torch.uint8)
    buf = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if huge and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            buf.madvise(mmap.MADV_HUGEPAGE)
        except OSError as e:  # EINVAL where the kernel was built without them: ordinary pages, same bytes
            log.debug("madvise(MADV_HUGEPAGE) refused: %s", e)
    return torch.frombuffer(buf, dtype=torch.uint8)[:nbytes]


def _span(t: Tensor) -> int:
    """Bytes ``t`` takes in an arena: its own, rounded up to ``ALIGN``."""
    return -(-t.numel() * t.element_size() // ALIGN) * ALIGN


def move_weights(model: nn.Module, mode: str | None = None) -> int:
    """The model's W8A8 linears' tiles, scales and scaled zeros moved into huge pages (one arena for the model),
    module by module, each old buffer freed as its module takes the copies. Returns the bytes moved (0 where the
    kernel gives no transparent huge pages). Run before anything caches the buffers' addresses (the native decode
    step: runtime/kernels/native_step.py)."""
    from runtime.kernels.w8a8 import W8A8Linear

    mode = thp_mode() if mode is None else mode
    if mode not in ("always", "madvise"):
        return 0
    linears = [m for m in model.modules() if isinstance(m, W8A8Linear)]
    if not linears or any(not t.is_contiguous() or t.device.type != "cpu" for m in linears for t in m.packed()):
        return 0
    space, off, nbytes = arena(sum(_span(t) for m in linears for t in m.packed())), 0, 0
    for m in linears:  # no list of the old buffers: each goes with its module's rebind
        moved = []
        for t in m.packed():
            n = t.numel() * t.element_size()
            moved.append(space[off:off + n].view(t.dtype).view(t.shape).copy_(t))
            off, nbytes = off + _span(t), nbytes + n
        m.rebind(*moved)
    return nbytes
