"""The engine against transformers' generate, on tiny random models of each family (fp32, greedy), dense and MoE;
and float16 refused where a model's activations overflow it."""
import threading

import pytest
import torch

from runtime.config import EngineConfig
from runtime.engine import Engine
from runtime.kernels import w8a8
from runtime.sequence import SamplingParams
from tiny_engine import hf_greedy, prompts, rtn4_folder, save_tiny
from tiny_models import BLOCK_VARIANTS, FAMILIES, MOE_FAMILIES

N_NEW = 12
GREEDY = SamplingParams(max_tokens=N_NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory, smol_tokenizer):
    """family -> (folder, HF model), each with the SmolLM2 tokenizer and vocab_size=len(tokenizer)."""
    out = {}
    for fam in FAMILIES + MOE_FAMILIES:
        path = tmp_path_factory.mktemp(fam)
        out[fam] = (str(path), save_tiny(fam, path, smol_tokenizer))
    return out


@pytest.mark.parametrize("chunk", [2048, 8])
@pytest.mark.parametrize("family", FAMILIES + MOE_FAMILIES)
def test_greedy_matches_transformers(tiny_dirs, family, chunk):
    path, hf = tiny_dirs[family]
    engine = Engine(EngineConfig(model=path, kv_cache_memory=1 << 24, max_num_batched_tokens=chunk, block_size=8))
    ps = prompts(hf.config.vocab_size)
    outs = engine.generate(ps, GREEDY)
    for p, o in zip(ps, outs):
        assert o.token_ids == hf_greedy(hf, p, N_NEW)
        assert o.finish_reason == "length" and o.completion_tokens == N_NEW and o.prompt_tokens == len(p)
    s = engine.stats()
    assert s["running"] == s["waiting"] == s["kv_blocks_used"] == 0


SLIDING = {  # an 8-token window, shorter than most prompts below
    "mistral": {"sliding_window": 8},
    "qwen2": {"use_sliding_window": True, "sliding_window": 8, "layer_types": ["full_attention", "sliding_attention"]},
    "mixtral": {"sliding_window": 8},
    "phi3": {"sliding_window": 8},  # every layer
    "gemma2": {},  # tests/tiny_models.py: window 8 on alternate layers, soft-capped scores
    "gemma3_text": {},  # window 8 on the sliding layers, which rotate with their own rope
}


@pytest.mark.parametrize("chunk", [2048, 8])
@pytest.mark.parametrize("family", sorted(SLIDING))
def test_sliding_window_matches_transformers(tmp_path, family, chunk):
    """Prompts and generations longer than the window attend to the last sliding_window positions only
    (every layer for Mistral/Mixtral, the sliding layers of Qwen2's layer_types), chunked or not, and
    with prompt-lookup speculation verifying several tokens at once."""
    hf = save_tiny(family, tmp_path, overrides=SLIDING[family])
    ps = prompts(hf.config.vocab_size, (5, 21, 40), seed=11)
    refs = [hf_greedy(hf, p, N_NEW) for p in ps]
    for draft in (None, "ngram"):
        engine = Engine(EngineConfig(model=str(tmp_path), kv_cache_memory=1 << 22, max_num_batched_tokens=chunk,
                                     block_size=4, draft=draft))
        assert engine.max_model_len > 40 + N_NEW  # longer requests than the window are served, not refused
        assert [o.token_ids for o in engine.generate(ps, GREEDY)] == refs


def test_llama3_rope_scaling(tmp_path):
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32, "rope_theta": 500000.0}
    hf = save_tiny("llama", tmp_path, overrides={"rope_parameters": scaling})
    assert hf.config.rope_parameters["rope_type"] == "llama3"
    engine = Engine(EngineConfig(model=str(tmp_path), kv_cache_memory=1 << 22))
    p = prompts(hf.config.vocab_size, (60,))[0]
    assert engine.generate([p], GREEDY)[0].token_ids == hf_greedy(hf, p, N_NEW)


def test_preemption_under_a_tiny_pool_keeps_greedy_outputs(tiny_dirs):
    path, hf = tiny_dirs["llama"]
    ps = prompts(hf.config.vocab_size, (9, 14, 5, 11, 7, 16), seed=3)
    big = Engine(EngineConfig(model=path, kv_cache_memory=1 << 24, block_size=4)).generate(ps, GREEDY)
    small = Engine(EngineConfig(model=path, num_kv_blocks=9, block_size=4, max_num_seqs=6, enable_prefix_caching=False))
    outs = small.generate(ps, GREEDY)
    assert [o.token_ids for o in outs] == [o.token_ids for o in big]
    assert small.stats()["num_preemptions"] > 0
    assert small.block_manager.num_free_blocks == 9


def test_prefix_caching_shares_blocks_and_keeps_outputs(tiny_dirs):
    path, hf = tiny_dirs["qwen2"]
    base = prompts(hf.config.vocab_size, (37,), seed=4)[0]
    ps = [base + [5, 6], base + [7], base[:20]]
    engine = Engine(EngineConfig(model=path, kv_cache_memory=1 << 24, block_size=8))
    first = engine.generate(ps[:1], GREEDY)
    rest = engine.generate(ps[1:], GREEDY)
    assert engine.stats()["prefix_cache_hit_tokens"] >= 32 + 16
    for p, o in zip(ps, first + rest):
        assert o.token_ids == hf_greedy(hf, p, N_NEW)


def test_abort_frees_blocks(tiny_dirs):
    path, hf = tiny_dirs["llama"]
    engine = Engine(EngineConfig(model=path, kv_cache_memory=1 << 22, block_size=4))
    free0 = engine.block_manager.num_free_blocks
    a = engine.add_request(prompts(hf.config.vocab_size, (30,))[0], SamplingParams(max_tokens=50, ignore_eos=True))
    b = engine.add_request([5, 6, 7], SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.block_manager.num_free_blocks < free0
    engine.abort(a)
    outs = {o.request_id: o for o in engine.step()}
    assert outs[a].finished and outs[a].finish_reason == "abort"
    engine.abort(b)
    engine.step()
    assert not engine.has_unfinished()
    assert engine.block_manager.num_used_blocks == 0
    engine.abort("no-such-request")  # unknown ids are ignored
    assert engine.step() == []


def test_kv_slot_stats_count_every_token_of_running_sequences(tiny_dirs):
    """Used slots are the sequences' tokens (computed or about to be); allocated is whole blocks, so
    the difference is only each sequence's partly filled last block."""
    path, hf = tiny_dirs["llama"]
    engine = Engine(EngineConfig(model=path, kv_cache_memory=1 << 22, block_size=4, enable_prefix_caching=False))
    engine.add_request(prompts(hf.config.vocab_size, (10,))[0], SamplingParams(max_tokens=20, ignore_eos=True))
    engine.add_request([5, 6, 7], SamplingParams(max_tokens=20, ignore_eos=True))
    for step in range(1, 6):
        engine.step()
        s = engine.stats()
        computed = sum(seq.num_computed_tokens for seq in engine.scheduler.running)
        # every computed token, plus a sampled token whose slot is already allocated; at most 1 more each
        assert computed <= s["token_slots_used"] <= (10 + step) + (3 + step)
        if step == 1:  # after prefill both sampled tokens fall in already allocated blocks (10 -> 12, 3 -> 4)
            assert s["token_slots_used"] == 11 + 4
        assert 0 <= s["token_slots_allocated"] - s["token_slots_used"] < 2 * 4


def test_prompt_longer_than_max_model_len_is_refused(tiny_dirs):
    path, _ = tiny_dirs["llama"]
    engine = Engine(EngineConfig(model=path, kv_cache_memory=1 << 22, max_model_len=32))
    with pytest.raises(ValueError, match="max_model_len=32"):
        engine.add_request(list(range(3, 40)))
    with pytest.raises(ValueError, match="empty"):
        engine.add_request([])
    with pytest.raises(ValueError, match="max_model_len"):
        Engine(EngineConfig(model=path, num_kv_blocks=2, block_size=4, max_model_len=64))
    # a prompt that fills the context still yields one token, then stops for length
    out = engine.generate([list(range(3, 35))], SamplingParams(max_tokens=10, ignore_eos=True))[0]
    assert out.completion_tokens == 1 and out.finish_reason == "length"


def test_stops_min_tokens_and_text(tiny_dirs, smol_tokenizer):
    path, hf = tiny_dirs["llama"]
    engine = Engine(EngineConfig(model=path, kv_cache_memory=1 << 22))
    p = prompts(hf.config.vocab_size, (8,), seed=5)[0]
    ref = hf_greedy(hf, p, N_NEW)
    # a stop token id ends generation at its first occurrence (and is reported)
    out = engine.generate([p], SamplingParams(max_tokens=N_NEW, stop_token_ids=(ref[3],)))[0]
    assert out.finish_reason == "stop" and out.token_ids == ref[:ref.index(ref[3]) + 1]
    # min_tokens masks it until enough tokens exist
    params = SamplingParams(max_tokens=N_NEW, min_tokens=5, stop_token_ids=(ref[0],), ignore_eos=True)
    out = engine.generate([p], params)[0]
    assert ref[0] not in out.token_ids[:5] and len(out.token_ids) >= 5
    # text equals the tokenizer's decoding; a stop string cuts it
    full = engine.generate([p], GREEDY)[0]
    assert full.text == smol_tokenizer.decode(ref, skip_special_tokens=True)
    stop = full.text[len(full.text) // 2:][:3]
    if stop.strip():
        cut = engine.generate([p], SamplingParams(max_tokens=N_NEW, stop=(stop,), ignore_eos=True))[0]
        assert cut.finish_reason == "stop" and cut.text == full.text[:full.text.index(stop)]
    # streaming deltas add up to the final text
    chunks = list(engine.stream(p, GREEDY))
    assert "".join(c.text_delta for c in chunks) == full.text and chunks[-1].finished
    assert sum(len(c.new_token_ids) for c in chunks) == N_NEW


def test_text_prompts_and_sampling_seeds(tiny_dirs):
    path, _ = tiny_dirs["gemma"]
    engine = Engine(EngineConfig(model=path, kv_cache_memory=1 << 22, seed=1))
    params = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, max_tokens=10, ignore_eos=True, seed=123)
    a = engine.generate(["Hello there"], params)[0]
    b = engine.generate(["Hello there", "Another prompt"], [params, params])[0]
    assert a.token_ids == b.token_ids  # a per-request seed is independent of the batch
    c = engine.generate(["Hello there"], SamplingParams(temperature=0.8, max_tokens=10, ignore_eos=True, seed=7))[0]
    assert c.token_ids != a.token_ids
    assert a.prompt_tokens == len(engine.encode("Hello there"))


def test_requests_from_another_thread(tiny_dirs):
    path, hf = tiny_dirs["qwen3"]
    engine = Engine(EngineConfig(model=path, kv_cache_memory=1 << 22))
    ps = prompts(hf.config.vocab_size, (4, 9, 13, 6), seed=6)
    done: dict[str, list[int]] = {}
    ids: list[str] = []

    def producer():
        for p in ps:
            ids.append(engine.add_request(p, GREEDY))

    t = threading.Thread(target=producer)
    t.start()
    while t.is_alive() or engine.has_unfinished() or len(done) < len(ps):
        for out in engine.step():
            done.setdefault(out.request_id, []).extend(out.new_token_ids)
    t.join()
    for rid, p in zip(ids, ps):
        assert done[rid] == hf_greedy(hf, p, N_NEW)


def test_quantized_checkpoint_matches_transformers_with_the_same_quantlinears(tmp_path, smol_tokenizer):
    from compress.format.checkpoint import build_quantization_config, save_quantized, set_module
    from compress.format.qlinear import QuantLinear
    from compress.format.quant import Scheme, quantize_weight

    hf = save_tiny("llama", tmp_path / "fp", smol_tokenizer)
    scheme = Scheme(bits=4, group_size=32, sym=False)
    for name, mod in list(hf.named_modules()):
        if isinstance(mod, torch.nn.Linear) and name != "lm_head":
            set_module(hf, name, QuantLinear.from_quantized(quantize_weight(mod.weight.data, scheme), bias=mod.bias))
    save_quantized(hf, smol_tokenizer, tmp_path / "q", build_quantization_config(hf, "rtn", scheme))
    ps = prompts(hf.config.vocab_size, (6, 19), seed=7)
    exact = Engine(EngineConfig(model=str(tmp_path / "q"), kv_cache_memory=1 << 22, quant_kernel="dequant",
                          dtype="float32"))
    for p, o in zip(ps, exact.generate(ps, GREEDY)):
        assert o.token_ids == hf_greedy(hf, p, N_NEW)
    packed = Engine(EngineConfig(model=str(tmp_path / "q"), kv_cache_memory=1 << 22, quant_kernel="packed",
                                 dtype="float32"))
    path = "w8a8" if w8a8.available() else "int4pack"  # the VNNI kernel where the CPU has it
    assert packed.runner.kernel_paths == {path: 2 * hf.config.num_hidden_layers + 2 * hf.config.num_hidden_layers}
    # packed kernels run bf16 or int8 activations: compare the first step's logits rather than whole sequences
    from runtime.model_runner import ForwardItem

    p = ps[1]
    item = ForwardItem(p, 0, list(range(-(-len(p) // 16))), 1)
    ref = hf(torch.tensor([p])).logits[0, -1]
    got = packed.runner.forward([item])[0]
    # int8 activations (w8a8) add their rounding to the bf16 one on this tiny random model's flat logits
    assert (got - ref).norm() / ref.norm() < (4e-2 if path == "w8a8" else 2e-2)


@pytest.mark.parametrize("family", BLOCK_VARIANTS)
def test_new_families_torch_ops_path_and_logits(tiny_dirs, family):
    """The torch reference ops give transformers' greedy tokens too (the default path runs the fused CPU kernels),
    and the first step's logits equal transformers' (greedy tokens cannot see Gemma 2's final soft-capping or
    Granite's logits_scaling: both keep the argmax)."""
    from runtime.model_runner import ForwardItem

    path, hf = tiny_dirs[family]
    engine = Engine(EngineConfig(model=path, kv_cache_memory=1 << 22, max_num_batched_tokens=8, block_size=4,
                                 fused_cpu_kernels=False))
    assert engine.runner.ops.name == "torch"
    ps = prompts(hf.config.vocab_size, (5, 21, 40), seed=12)
    assert [o.token_ids for o in engine.generate(ps, GREEDY)] == [hf_greedy(hf, p, N_NEW) for p in ps]
    p = ps[2]
    got = engine.runner.forward([ForwardItem(p, 0, list(range(-(-len(p) // 4))), len(p))])
    with torch.no_grad():
        ref = hf(torch.tensor([p])).logits[0]
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("family", BLOCK_VARIANTS)
def test_rtn4_checkpoint_matches_transformers(tmp_path, family, fused):
    """An rtn4 folder of each new family (Phi-3's fused qkv_proj and gate_up_proj quantized as stored) served with
    dequantized weights gives the greedy tokens of transformers running the same QuantLinears, across the windows."""
    hf = save_tiny(family, tmp_path / "fp", overrides=SLIDING.get(family))
    rtn4_folder(hf, tmp_path / "q")
    engine = Engine(EngineConfig(model=str(tmp_path / "q"), kv_cache_memory=1 << 22, block_size=4, dtype="float32",
                                 quant_kernel="dequant", fused_cpu_kernels=fused))
    assert sum(engine.runner.kernel_paths.values()) == 4 * hf.config.num_hidden_layers  # qkv, o, gate_up, down
    ps = prompts(hf.config.vocab_size, (5, 21, 40), seed=13)
    assert [o.token_ids for o in engine.generate(ps, GREEDY)] == [hf_greedy(hf, p, N_NEW) for p in ps]


def test_float16_is_refused_where_activations_overflow_it(tmp_path, monkeypatch):
    """A Gemma 2 whose residual stream passes 65504 (a post-feedforward norm scaled up, as Gemma's massive
    activations do) serves in bf16 and fp32, but float16 is refused at load, naming the fix, instead of generating
    from NaN logits; a model within range serves in float16 (on a CPU that runs it: mocked here)."""
    from runtime import cpu
    from runtime.overflow import Float16Overflow

    monkeypatch.setattr(cpu, "cpu_info", lambda: cpu.CpuInfo("a CPU with AMX-FP16", 2, amx_bf16=True, amx_fp16=True))
    fine = save_tiny("gemma2", tmp_path / "fine")
    p = prompts(fine.config.vocab_size, (9,), seed=14)[0]
    engine = Engine(EngineConfig(model=str(tmp_path / "fine"), kv_cache_memory=1 << 22, dtype="float16"))
    assert engine.dtype == "float16"
    assert engine.generate([p], GREEDY)[0].token_ids == hf_greedy(fine, p, N_NEW)
    loud = save_tiny("gemma2", tmp_path / "loud")
    with torch.no_grad():
        loud.model.layers[0].post_feedforward_layernorm.weight.fill_(3e4)
        peak = max(h.abs().max() for h in loud(torch.tensor([p]), output_hidden_states=True).hidden_states)
    assert peak > torch.finfo(torch.float16).max
    loud.save_pretrained(tmp_path / "loud")
    with pytest.raises(Float16Overflow, match="exceed float16's range.*--dtype bfloat16"):
        Engine(EngineConfig(model=str(tmp_path / "loud"), kv_cache_memory=1 << 22, dtype="float16"))
    for dtype in ("bfloat16", "float32"):
        out = Engine(EngineConfig(model=str(tmp_path / "loud"), kv_cache_memory=1 << 22, dtype=dtype))
        assert out.generate([p], GREEDY)[0].completion_tokens == N_NEW
    assert Engine(EngineConfig(model=str(tmp_path / "loud"), kv_cache_memory=1 << 22)).dtype == "float32"  # auto: own


@pytest.mark.parametrize("method", ["rtn", "gptq", "awq"])
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_compress_quantized_moe_matches_the_torch_quantized_model(tiny_dirs, tmp_path, calib_text, family, method):
    """A `compress quantize` MoE folder (packed experts) served by the engine gives the greedy tokens of the
    same folder loaded by compress's own loader (transformers with QuantLinear and PackedMoEExperts)."""
    from compress.config import QuantizeConfig
    from compress.format.checkpoint import load_quantized
    from compress.format.moe_packed import PackedMoEExperts
    from compress.job import quantize_to_folder

    out = tmp_path / "q"
    cfg = QuantizeConfig.from_flat(method=method, bits=4, group_size=32, calib=str(calib_text), nsamples=8, seqlen=64,
                                   search_tokens=256)
    quantize_to_folder(tiny_dirs[family][0], cfg, str(out))
    ref = load_quantized(out)
    assert all(isinstance(layer.mlp.experts, PackedMoEExperts) for layer in ref.model.layers)
    ps = prompts(ref.config.vocab_size, (6, 19), seed=9)
    refs = [hf_greedy(ref, p, N_NEW) for p in ps]
    exact = Engine(EngineConfig(model=str(out), kv_cache_memory=1 << 22, quant_kernel="dequant", dtype="float32"))
    assert exact.runner.kernel_paths["experts-dequant"] == ref.config.num_hidden_layers
    assert [o.token_ids for o in exact.generate(ps, GREEDY)] == refs
    for moe in exact.runner.model.moe_modules():  # experts packed again: dequantized per call, same numbers
        moe.gate_up_proj.cache_weight(False)
        moe.down_proj.cache_weight(False)
    assert [o.token_ids for o in exact.generate(ps, GREEDY)] == refs
    # the default kernels keep the experts packed (dense linears take the bf16 packed kernels: not bit-exact)
    auto = Engine(EngineConfig(model=str(out), kv_cache_memory=1 << 22))
    assert auto.runner.kernel_paths["experts-packed"] == ref.config.num_hidden_layers
    assert auto.generate(ps[:1], GREEDY)[0].completion_tokens == N_NEW


@pytest.mark.parametrize("family", ["llama", "qwen2_moe"])
def test_bfloat16_engine_tracks_fp32_logits(tiny_dirs, family):
    """bf16 compute (prepacked oneDNN linears on CPU; bf16 experts, fp32 router) stays within bf16 rounding
    of the fp32 model."""
    from runtime.model_runner import ForwardItem

    path, hf = tiny_dirs[family]
    engine = Engine(EngineConfig(model=path, kv_cache_memory=1 << 22, dtype="bfloat16"))
    p = prompts(hf.config.vocab_size, (23,), seed=8)[0]
    got = engine.runner.forward([ForwardItem(p, 0, list(range(-(-len(p) // 16))), 1)])[0]
    ref = hf(torch.tensor([p])).logits[0, -1]
    assert (got - ref).norm() / ref.norm() < 3e-2
    out = engine.generate([p], GREEDY)[0]
    assert out.completion_tokens == N_NEW


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_cuda_without_a_device_is_refused(tiny_dirs):
    with pytest.raises(ValueError, match="no CUDA device"):
        Engine(EngineConfig(model=tiny_dirs["llama"][0], device="cuda"))
