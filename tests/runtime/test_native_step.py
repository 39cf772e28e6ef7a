"""The native decode step (runtime/kernels/native_step.py, cpu/decode_step.cpp) against the per-op path it replaces:
the same greedy tokens in fp32 and the same logits in bf16, for each form it takes (GQA, MHA, MQA, biases, sliding
windows, Gemma's norm offset, Qwen3's q/k norms, Gemma 2's sandwich norms and soft-capping, Gemma 3's two rotaries,
Phi-3's partial rotary, Granite's multipliers, 8-bit KV caches), on one and two threads, keys split or not; and
every layer it cannot take keeps the per-op path, with the reason logged."""
import logging

import pytest
import torch

from runtime.config import EngineConfig
from runtime.engine import Engine
from runtime.kernels import cpu_ext, w8a8
from runtime.model_runner import ForwardItem, ModelRunner
from runtime.models.loader import open_checkpoint
from runtime.sequence import SamplingParams
from tiny_engine import prompts, rtn4_folder, save_tiny

pytestmark = pytest.mark.skipif(not (cpu_ext.load() and w8a8.available()),
                                reason="the fused CPU kernels with AVX512-VNNI are not available here")

FORMS = {  # name: (family, config overrides)
    "llama-gqa": ("llama", {}),
    "llama-mha-biases": ("llama", {"num_key_value_heads": 4, "attention_bias": True, "mlp_bias": True}),
    "llama-mqa": ("llama", {"num_key_value_heads": 1}),
    "qwen2-qkv-bias": ("qwen2", {}),
    "mistral-window": ("mistral", {"sliding_window": 8}),
    "gemma-offset": ("gemma", {}),
    "qwen3-qk-norms": ("qwen3", {}),
    "gemma2-sandwich-softcap": ("gemma2", {}),  # windowed and global layers alternate
    "gemma3-two-rotaries": ("gemma3_text", {}),  # sandwich norms, q/k norms, a rotary per layer type
    "phi3-partial-rotary": ("phi3", {}),
    "granite-multipliers": ("granite", {}),
}


def _rtn4(tmp_path, family: str, overrides: dict) -> str:
    hf = save_tiny(family, tmp_path / "fp", overrides=overrides)
    rtn4_folder(hf, tmp_path / "q")
    return str(tmp_path / "q")


def _counting(runner: ModelRunner) -> list[int]:
    """Counts the native step's calls (one per forward it takes)."""
    calls, step = [], runner.model.native_step
    run = step.run
    step.run = lambda *a: calls.append(1) or run(*a)
    return calls


@pytest.mark.parametrize("form,kv", [(f, "auto") for f in sorted(FORMS)] + [("llama-gqa", "int8"),
                                                                             ("qwen2-qkv-bias", "fp8_e4m3")])
def test_greedy_tokens_equal_the_per_op_path(tmp_path, form, kv):
    """fp32, batched decode of ragged prompts (prefill chunks between): the same tokens with and without the step,
    with a KV cache in the compute dtype or 8-bit."""
    path = _rtn4(tmp_path, *FORMS[form])
    ps, outs = prompts(256), []
    for native in (True, False):
        engine = Engine(EngineConfig(model=path, dtype="float32", kv_cache_memory=1 << 22, block_size=4,
                                     max_num_batched_tokens=16, native_decode_step=native, kv_cache_dtype=kv))
        assert (engine.runner.model.native_step is not None) is native
        calls = _counting(engine.runner) if native else []
        outs.append([o.token_ids for o in engine.generate(ps, SamplingParams(max_tokens=10, ignore_eos=True))])
        assert len(calls) >= 9 * native  # every decode step ran natively
    assert outs[0] == outs[1]


def _logits(path: str, dtype: str, native: bool, prompt: list[int], forced: list[int],
            max_len: int = 128) -> torch.Tensor:
    """Logits of the prefill and of each forced decode step (the same tokens on both paths)."""
    blocks = -(-(max_len + 1) // 4)
    runner = ModelRunner(open_checkpoint(path), blocks, 4, dtype, "cpu", "auto", max_len + 1, native_step=native)
    table = list(range(blocks))
    rows = [runner.forward([ForwardItem(prompt, 0, table, 1)])]
    for i, tok in enumerate(forced):
        rows.append(runner.forward([ForwardItem([tok], len(prompt) + i, table, 1)]))
    return torch.cat(rows)


@pytest.mark.parametrize("form", ["llama-gqa", "qwen2-qkv-bias", "gemma-offset", "qwen3-qk-norms",
                                  "gemma2-sandwich-softcap"])
@pytest.mark.parametrize("threads", [1, 2])
def test_bf16_logits_equal_the_per_op_path(tmp_path, form, threads):
    """bf16: the step runs the per-op path's kernels op for op, with the same roundings in between, so the logits
    agree to within a bf16 rounding (two threads share out the KV heads: each head still computed alike)."""
    path = _rtn4(tmp_path, *FORMS[form])
    prompt, forced = prompts(256, (21, 8), seed=3)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got, ref = (_logits(path, "bfloat16", native, prompt, forced) for native in (True, False))
    finally:
        torch.set_num_threads(old)
    torch.testing.assert_close(got, ref, rtol=2 ** -8, atol=2 ** -8)


def test_long_context_splits_keys_across_threads(tmp_path):
    """A context long enough that two threads split each sequence's keys (decode_attention.cpp's units, merged)."""
    hf = save_tiny("llama", tmp_path / "fp", hidden=256, overrides={"max_position_embeddings": 2048})
    rtn4_folder(hf, tmp_path / "q")  # 4 heads of 64: 1024 keys make decode_attention.cpp's large call
    prompt, forced = prompts(256, (1100, 3), seed=4)
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        got, ref = (_logits(str(tmp_path / "q"), "float32", native, prompt, forced, 1200) for native in (True, False))
    finally:
        torch.set_num_threads(old)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family,quantized,options,reason", [
    ("olmoe", True, {}, "q/k norms over the whole projections"),
    ("olmo2", True, {}, "post norms"),
    ("mixtral", True, {}, "a sparse MoE MLP"),
    ("llama", False, {}, "not w8a8"),
    ("llama", True, {"fused_cpu_kernels": False}, "the torch path"),
    ("llama", True, {"native_decode_step": False}, "native_decode_step=False"),
])
def test_what_the_step_cannot_take_keeps_the_per_op_path(tmp_path, caplog, family, quantized, options, reason):
    hf = save_tiny(family, tmp_path / "fp")
    if quantized:
        rtn4_folder(hf, tmp_path / "q")
    path = str(tmp_path / ("q" if quantized else "fp"))
    with caplog.at_level(logging.INFO, logger="runtime.kernels.native_step"):
        engine = Engine(EngineConfig(model=path, dtype="float32", kv_cache_memory=1 << 22, block_size=4, **options))
    assert engine.runner.model.native_step is None
    assert "decode step: per-op path" in caplog.text and reason in caplog.text
    out = engine.generate(prompts(hf.config.vocab_size, (7,)), SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(out[0].token_ids) == 3
