"""--dtype auto from the CPU's features (mocked: these machines differ between sessions)."""
import logging

import pytest

from runtime.cpu import CpuInfo, cpu_info, resolve_dtype

AMX = CpuInfo("Intel Xeon (AMX)", 2, amx_bf16=True, avx512_bf16=True)
EPYC = CpuInfo("AMD EPYC", 2, avx512_bf16=True)
OLD = CpuInfo("Intel Xeon (AVX2)", 2)
FP16 = CpuInfo("Intel Xeon 6 (AMX-FP16)", 2, amx_bf16=True, amx_fp16=True)


@pytest.mark.parametrize("info", [AMX, EPYC])
def test_auto_runs_quantized_checkpoints_in_bf16_where_the_cpu_has_it(info):
    choice = resolve_dtype("auto", "cpu", "float32", quantized=True, info=info)
    assert choice.dtype == "bfloat16" and info.name in choice.reason


def test_auto_keeps_fp32_without_native_bf16():
    for quantized, model_dtype in [(True, "float32"), (False, "bfloat16")]:
        choice = resolve_dtype("auto", "cpu", model_dtype, quantized=quantized, info=OLD)
        assert choice.dtype == "float32" and "no native bf16" in choice.reason


def test_auto_keeps_an_fp_checkpoint_in_its_own_precision():
    assert resolve_dtype("auto", "cpu", "float32", quantized=False, info=EPYC).dtype == "float32"
    assert resolve_dtype("auto", "cpu", None, quantized=False, info=EPYC).dtype == "float32"
    assert resolve_dtype("auto", "cpu", "bfloat16", quantized=False, info=EPYC).dtype == "bfloat16"
    assert resolve_dtype("auto", "cpu", "float16", quantized=False, info=EPYC).dtype == "bfloat16"


def test_explicit_dtypes():
    assert resolve_dtype("float32", "cpu", "bfloat16", quantized=True, info=AMX).dtype == "float32"
    assert resolve_dtype("float16", "cpu", None, quantized=False, info=FP16).dtype == "float16"
    assert resolve_dtype("bfloat16", "cuda", None, quantized=False, info=OLD).dtype == "bfloat16"
    assert resolve_dtype("float16", "cuda", "bfloat16", quantized=False, info=OLD).dtype == "float16"


@pytest.mark.parametrize("model_dtype,quantized,expected", [
    ("bfloat16", False, "bfloat16"),  # Gemma and most current checkpoints
    ("float32", False, "float32"),  # fp32 stays fp32
    ("float16", False, "bfloat16"),  # never float16 by default: the same size with float32's range
    (None, False, "bfloat16"),
    ("float32", True, "bfloat16"),  # quantized: bf16 activations for the packed kernels
])
def test_auto_on_a_gpu_follows_the_checkpoint(model_dtype, quantized, expected):
    choice = resolve_dtype("auto", "cuda", model_dtype, quantized=quantized, info=OLD)
    assert choice.dtype == expected and choice.reason


def test_dtypes_this_cpu_cannot_run_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="float16.*AMD EPYC.*no AVX512-FP16 or AMX-FP16"):
        resolve_dtype("float16", "cpu", None, quantized=False, info=EPYC)
    with pytest.raises(ValueError, match="dtype='int8' is not supported"):
        resolve_dtype("int8", "cpu", None, quantized=False, info=EPYC)


def test_emulated_bf16_runs_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING):
        assert resolve_dtype("bfloat16", "cpu", None, quantized=True, info=OLD).dtype == "bfloat16"
    assert "emulated" in caplog.text


def test_this_machine_is_described():
    info = cpu_info()
    assert info.name and info.physical_cores >= 1
