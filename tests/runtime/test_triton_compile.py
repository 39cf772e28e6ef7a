"""The Triton kernels compile for a real GPU (sm_90, Hopper) even on this CPU-only machine.

The interpreter (test_triton_attention/qmatmul) checks the arithmetic but accepts code the compiler
rejects (non-constexpr globals, unsupported control flow, type mismatches in tl.dot). Triton's wheel
ships ptxas, so each kernel is compiled here, ahead of time, to a cubin, in a subprocess without
TRITON_INTERPRET (the mode is fixed per process once Triton loads).
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = r'''
import sys, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import runtime.kernels.triton_attention as ta
import runtime.kernels.triton_moe as tm
import runtime.kernels.triton_qmatmul as tq

target = GPUTarget("cuda", int(sys.argv[1]), 32)

def compile_kernel(fn, types, const):
    sig = {n: "constexpr" if n in const else types.get(n, "i32") for n in fn.arg_names}
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=dict(const)), target=target)
    assert len(k.asm["cubin"]) > 0
    print(fn.__name__, "ok", flush=True)

def qmm(dt, m, bits, zeros, gidx, nf4):
    bm, bn, bk = tq.block_sizes(m, {"fp16": tq.torch.float16, "bf16": tq.torch.bfloat16, "fp32": tq.torch.float32}[dt])
    types = dict(x_ptr=f"*{dt}", qw_ptr="*i32", s_ptr="*fp16", z_ptr="*u8", gidx_ptr="*i32", cb_ptr="*fp32", out_ptr=f"*{dt}")
    compile_kernel(tq._qmatmul_kernel, types, dict(BITS=bits, HAS_ZEROS=zeros, HAS_GIDX=gidx, IS_NF4=nf4,
                   DOT_PRECISION="ieee" if dt == "fp32" else "tf32", BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk))

def moe(dt, m, quant, bits=4, zeros=True, gidx=False, nf4=False):
    bm, bn, bk = tq.block_sizes(m, {"fp16": tq.torch.float16, "bf16": tq.torch.bfloat16, "fp32": tq.torch.float32}[dt])
    types = dict(x_ptr=f"*{dt}", rows_ptr="*i64", tile_expert_ptr="*i32", tile_start_ptr="*i32", expert_end_ptr="*i32",
                 w_ptr="*i32" if quant else f"*{dt}", s_ptr="*fp16", z_ptr="*u8", gidx_ptr="*i32", cb_ptr="*fp32",
                 out_ptr=f"*{dt}")
    compile_kernel(tm._grouped_kernel, types, dict(GATHER=True, QUANT=quant, BITS=bits, HAS_ZEROS=zeros,
                   HAS_GIDX=gidx, IS_NF4=nf4, DOT_PRECISION="ieee" if dt == "fp32" else "tf32",
                   BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk))

def attention(dt, group, head_dim, max_q, kv=None, softcap=False):
    """kv: None (a cache in dt), "i8" or "fp8e4nv" (8-bit codes with fp16 scales: runtime/kernels/kv_quant.py);
    softcap: Gemma 2's soft-capped scores"""
    bd = triton.next_power_of_2(head_dim)
    prec = "ieee" if dt == "fp32" else "tf32"
    cache = kv or dt
    ptrs = dict(q_ptr=f"*{dt}", k_ptr=f"*{cache}", v_ptr=f"*{cache}", ks_ptr="*fp16" if kv else f"*{cache}",
                vs_ptr="*fp16" if kv else f"*{cache}", bt_ptr="*i32", seq_lens_ptr="*i32", qk_scale="fp32",
                softcap="fp32")
    bm, bn = ta.prefill_tiles(max_q, head_dim)
    compile_kernel(ta._prefill_kernel, {**ptrs, "cu_q_ptr": "*i32", "out_ptr": f"*{dt}"},
                   dict(GROUP=group, BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=bd, DOT_PRECISION=prec, QUANT=kv is not None,
                        SOFTCAP=softcap))
    compile_kernel(ta._decode_partition_kernel, {**ptrs, "part_out_ptr": "*fp32", "part_m_ptr": "*fp32",
                   "part_l_ptr": "*fp32"}, dict(GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)),
                   BLOCK_N=32, BLOCK_D=bd, PARTITION=256, DOT_PRECISION=prec, QUANT=kv is not None,
                   SOFTCAP=softcap))
    if kv:
        return
    compile_kernel(ta._decode_reduce_kernel, dict(part_out_ptr="*fp32", part_m_ptr="*fp32", part_l_ptr="*fp32",
                   out_ptr=f"*{dt}"), dict(BLOCK_P=8, BLOCK_D=bd))

qmm("fp16", 1, 4, True, False, False)
attention("fp16", 3, 64, 512)   # SmolLM2-135M: 9 query heads over 3 KV heads of dim 64
moe("fp16", 8, True)            # w4a16 grouped MoE GEMM
moe("fp16", 8, False)           # fp experts
attention("fp16", 3, 64, 512, "i8")  # the int8 KV cache
attention("bf16", 2, 256, 512, softcap=True)  # Gemma 2: soft-capped scores, head_dim 256
if sys.argv[2] == "all":
    qmm("bf16", 300, 4, False, True, False)
    qmm("fp32", 300, 3, False, False, True)
    moe("bf16", 300, True, 4, False, True)
    moe("fp32", 300, True, 4, False, False, True)
    attention("bf16", 1, 128, 8)
    attention("fp32", 4, 80, 100)
    attention("bf16", 3, 64, 8, "fp8e4nv")  # the fp8 KV cache (Hopper converts e4m3 natively)
'''


def _ptxas() -> Path | None:
    import importlib.util

    spec = importlib.util.find_spec("triton")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "backends" / "nvidia" / "bin" / "ptxas"
    return path if path.is_file() else None


def _compile(variants: str, tmp_path) -> str:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path / "cache"), TRITON_DEFAULT_FP_FUSION="1")
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", SCRIPT, "90", variants], cwd=root, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout


needs_ptxas = pytest.mark.skipif(_ptxas() is None, reason="this Triton install has no bundled ptxas to compile with")


@needs_ptxas
def test_kernels_compile_for_hopper(tmp_path):
    """fp16 (the serving dtype): the dequant-GEMM, the three attention kernels, the grouped MoE GEMM (int4, fp),
    the two attention kernels on an int8 KV cache; the three with Gemma 2's soft-capping (bf16)."""
    assert _compile("fp16", tmp_path).count(" ok") == 11


@needs_ptxas
@pytest.mark.slow
def test_every_dtype_and_variant_compiles(tmp_path):
    """bf16 and fp32 too, act-order g_idx, nf4, 3-bit, MQA, head_dim 128 and a non-power-of-two 80, fp8 KV."""
    assert _compile("all", tmp_path).count(" ok") == 23
