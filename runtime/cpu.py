"""What this CPU can do, detected rather than assumed, and the compute dtype that follows from it.

These machines differ from session to session (an Intel Xeon with AMX, an AMD EPYC with AVX-512 BF16 and
no AMX, ...). ``--dtype auto`` follows the checkpoint's own dtype (``dtype``/``torch_dtype`` in its config):
float32 stays float32, bf16 runs bf16, and float16 runs bf16 (the same size with float32's range; auto never
picks float16, whose 65504 ceiling Gemma's activations pass). Quantized checkpoints run bf16 for their packed
kernels. On CPU bf16 is used only where the CPU multiplies it natively (AVX512-BF16 or AMX-BF16): the packed
int4/int8 kernels and oneDNN's bf16 GEMMs are the fast paths there; elsewhere bf16 is emulated (several times
slower than fp32), so ``auto`` keeps fp32. Explicit dtypes that cannot run well are refused with the reason;
an explicit float16 that overflows on the model is refused at load (runtime/overflow.py).
"""
from __future__ import annotations

import functools
import logging
import platform
from dataclasses import dataclass

import torch

from runtime.config import DTYPES

log = logging.getLogger(__name__)



@dataclass(frozen=True)
class CpuInfo:
    """The features that decide the compute dtype, and the name that goes into benchmark rows."""

    name: str
    physical_cores: int
    avx512_bf16: bool = False
    amx_bf16: bool = False
    avx512_fp16: bool = False
    amx_fp16: bool = False

    @property
    def native_bf16(self) -> bool:
        return self.avx512_bf16 or self.amx_bf16

    @property
    def native_fp16(self) -> bool:
        return self.avx512_fp16 or self.amx_fp16


def _model_name() -> str:
    """The CPU's marketing name from /proc/cpuinfo (torch only reports the vendor)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


@functools.cache
def cpu_info() -> CpuInfo:
    """This machine's CPU features (torch's own detection: what its kernels will dispatch on)."""
    caps = torch.cpu.get_capabilities() if hasattr(torch.cpu, "get_capabilities") else {}
    return CpuInfo(name=_model_name(), physical_cores=int(caps.get("num_physical_cores") or 1),
                   avx512_bf16=bool(caps.get("avx512_bf16")), amx_bf16=bool(caps.get("amx_bf16")),
                   avx512_fp16=bool(caps.get("avx512_fp16")), amx_fp16=bool(caps.get("amx_fp16")))


@dataclass(frozen=True)
class DtypeChoice:
    dtype: str
    reason: str


def _accelerator_auto(model_dtype: str | None, quantized: bool) -> DtypeChoice:
    """``auto`` on a GPU: the checkpoint's own dtype, except float16, which becomes bf16 (the same memory with
    float32's range: Gemma's activations, for one, overflow float16), and quantized checkpoints, whose kernels run
    bf16 activations. A checkpoint that names no dtype runs bf16, as most current models are stored."""
    if quantized:
        return DtypeChoice("bfloat16", "quantized checkpoint: bf16 activations for its kernels")
    if model_dtype == "float32":
        return DtypeChoice("float32", "checkpoint stored in float32: its own precision")
    if model_dtype == "float16":
        return DtypeChoice("bfloat16", "checkpoint stored in float16: bf16 has the same size and float32's range, "
                           "so activations beyond float16's 65504 cannot overflow")
    return DtypeChoice("bfloat16", f"checkpoint stored in {model_dtype or 'an unnamed dtype'}")


def resolve_dtype(requested: str, device: str, model_dtype: str | None, quantized: bool,
                  info: CpuInfo | None = None) -> DtypeChoice:
    """The engine's compute dtype for ``requested`` ("auto" or an explicit one) on ``device``.

    ``model_dtype`` is the checkpoint's own (``torch_dtype`` in its config); ``quantized`` says whether its
    linears are packed integers, whose kernels run bf16 activations.
    """
    if requested not in DTYPES:
        raise ValueError(f"dtype={requested!r} is not supported; use one of {DTYPES}")
    if device != "cpu":
        return DtypeChoice(requested, "requested") if requested != "auto" else _accelerator_auto(model_dtype, quantized)
    info = info or cpu_info()
    if requested == "float16" and not info.native_fp16:
        raise ValueError(f"dtype='float16' cannot run well on this CPU ({info.name}: no AVX512-FP16 or AMX-FP16, "
                         "so every fp16 op is emulated); use --dtype auto, bfloat16 or float32")
    if requested != "auto":
        if requested == "bfloat16" and not info.native_bf16:
            log.warning("dtype=bfloat16 on %s, which has no AVX512-BF16 or AMX-BF16: bf16 is emulated and slower "
                        "than float32 here", info.name)
        return DtypeChoice(requested, "requested")
    if not info.native_bf16:
        return DtypeChoice("float32", f"{info.name} has no native bf16 (AVX512-BF16/AMX-BF16)")
    if quantized:
        return DtypeChoice("bfloat16", f"quantized checkpoint; {info.name} has native bf16")
    if model_dtype in ("bfloat16", "float16"):
        return DtypeChoice("bfloat16", f"checkpoint stored in {model_dtype}; {info.name} has native bf16")
    return DtypeChoice("float32", f"checkpoint stored in {model_dtype or 'float32'}: its own precision")
