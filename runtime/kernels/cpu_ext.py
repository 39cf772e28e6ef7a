"""Builds runtime/kernels/cpu/*.cpp once per machine and loads it as ``torch.ops.compress_cpu``.

The build is a single ``c++`` call (all sources into one library) against torch's headers (no ninja, no
setuptools), cached under ``$COMPRESS_CACHE`` (default ``~/.cache/compress``) in a folder keyed by the
sources, torch's version, the CPU model and the flags, written to a temporary name and renamed into place.
``-march=native`` makes the library this CPU's, hence the CPU in the key. Without a compiler, or if the build
or the load fails, the runtime keeps the torch path and says so in one log line; ``COMPRESS_FUSED_CPU=0``
turns the kernels off.
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from runtime.cpu import cpu_info

log = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).parent / "cpu"
SOURCES = tuple(SOURCE_DIR / f for f in ("fused_ops.cpp", "decode_attention.cpp", "qgemv.cpp", "fp_gemv.cpp",
                                          "tile_dequant.cpp", "decode_step.cpp", "gram.cpp",
                                          "cd.cpp"))
HEADERS = tuple(SOURCE_DIR / f for f in ("common.h", "qgemv.h", "fused_rows.h", "paged_attention.h"))
# -ffp-contract=off: no fused multiply-adds the torch reference does not make; -fno-math-errno and
# -fno-trapping-math let the exp/min/max/floor loops vectorize (no result changes for finite inputs)
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math", "-fopenmp", "-fPIC",
         "-shared", "-std=c++17", "-w"]


def cache_root() -> Path:
    return Path(os.environ.get("COMPRESS_CACHE") or Path.home() / ".cache" / "compress")


def _command(out: Path) -> list[str]:
    from torch.utils import cpp_extension

    includes = [f"-I{p}" for p in cpp_extension.include_paths()]
    lib = Path(torch.__file__).parent / "lib"
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return ([os.environ.get("CXX", "c++"), *map(str, SOURCES), "-o", str(out), *FLAGS, *includes,
             f"-D_GLIBCXX_USE_CXX11_ABI={abi}", f"-L{lib}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{lib}"])


def library_path() -> Path:
    """Where this machine's build of the kernels lives (it may not exist yet)."""
    key = hashlib.sha256()
    parts = [f.read_bytes() for f in SOURCES + HEADERS]
    for part in (*parts, torch.__version__.encode(), cpu_info().name.encode(), " ".join(FLAGS).encode()):
        key.update(part)
    return cache_root() / "kernels" / key.hexdigest()[:16] / "fused_ops.so"


def build(path: Path) -> None:
    """Compile the kernels into ``path`` (atomically: a partial build never sits at ``path``)."""
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        raise RuntimeError("no C++ compiler (c++) on PATH; apt-get install g++")
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        out = Path(tmp) / path.name
        proc = subprocess.run(_command(out), capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"compiling the CPU kernels ({SOURCE_DIR}) failed: {proc.stderr.strip()[-2000:]}")
        os.replace(out, path)


@functools.cache
def load() -> bool:
    """Build (first time on this machine, ~30 s) and load the kernels; False when the torch path must run."""
    if os.environ.get("COMPRESS_FUSED_CPU", "1") == "0":
        log.info("fused CPU kernels off (COMPRESS_FUSED_CPU=0): torch path")
        return False
    path = library_path()
    try:
        if not path.exists():
            log.info("building the fused CPU kernels into %s (once per machine)", path.parent)
            build(path)
        torch.ops.load_library(str(path))
        torch.ops.compress_cpu.rms_norm  # noqa: B018 - the namespace resolves only once the library loaded
    except (RuntimeError, OSError, AttributeError) as e:
        log.warning("fused CPU kernels unavailable, running the torch path: %s", e)
        return False
    return True
