"""The transformers backend: families without a native runtime model served by transformers' own modeling code
with the engine's paged KV cache, against transformers' generate and logits (tiny random models, fp32)."""
import json
import logging

import pytest
import torch

from runtime.config import EngineConfig
from runtime.engine import Engine
from runtime.model_runner import ForwardItem
from runtime.models.hf_backend import TransformersConfig
from runtime.sequence import SamplingParams
from tiny_engine import hf_greedy, prompts, save_tiny

N_NEW = 12
GREEDY = SamplingParams(max_tokens=N_NEW, ignore_eos=True)
VOCAB = 256


def tiny(family: str):
    """A tiny config of a family with no native runtime model (or, for gemma2/granite, served through transformers
    here on purpose: soft-capped attention and logits, a scaled head)."""
    import transformers as tf

    common = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=VOCAB,
                  max_position_embeddings=256)
    if family == "gpt_neox":  # partial rotary, parallel residual, fused interleaved qkv, untied embed_out
        return tf.GPTNeoXConfig(**common, rotary_pct=0.5)
    if family == "starcoder2":  # GQA, biases, every layer an 8-token sliding window
        return tf.Starcoder2Config(**common, num_key_value_heads=2, sliding_window=8)
    if family == "gemma2":  # attention scores and final logits soft-capped, sliding and global layers
        return tf.Gemma2Config(**common, num_key_value_heads=2, head_dim=16, sliding_window=8, query_pre_attn_scalar=16,
                               attn_logit_softcapping=5.0, final_logit_softcapping=3.0)
    if family == "granite":  # logits divided by logits_scaling in transformers' head
        return tf.GraniteConfig(**common, num_key_value_heads=2, embedding_multiplier=6.0, residual_multiplier=0.5,
                                attention_multiplier=0.2, logits_scaling=4.0)
    raise ValueError(family)


@pytest.fixture(scope="module")
def neox_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("neox")
    return path, save_tiny(tiny("gpt_neox"), path)


# (family, model_impl): gpt_neox and starcoder2 go to transformers on their own; gemma2 is forced there
PARITY = [("gpt_neox", "auto"), ("starcoder2", "auto"), ("gemma2", "transformers")]


@pytest.mark.parametrize(("chunk", "draft"), [(2048, None), (8, None), (8, "ngram")])
@pytest.mark.parametrize(("family", "impl"), PARITY)
def test_greedy_matches_transformers(tmp_path, family, impl, chunk, draft):
    """Prompts of different lengths decoded together (continuous batching, prefill then decode; chunked prefill
    with chunk=8; several tokens verified at once with prompt-lookup drafts) give transformers' greedy tokens."""
    hf = save_tiny(tiny(family), tmp_path)
    ps = prompts(VOCAB, (5, 16, 21, 1, 40), seed=11)
    engine = Engine(EngineConfig(model=str(tmp_path), kv_cache_memory=1 << 22, block_size=4,
                                 max_num_batched_tokens=chunk, draft=draft, model_impl=impl))
    outs = engine.generate(ps, GREEDY)
    assert [o.token_ids for o in outs] == [hf_greedy(hf, p, N_NEW) for p in ps]
    s = engine.stats()
    assert s["running"] == s["waiting"] == s["kv_blocks_used"] == 0


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
@pytest.mark.parametrize("family", ["gemma2", "granite"])
def test_logits_match_transformers(tmp_path, family, kv_cache_dtype):
    """Prefill and decode logits equal transformers' own, soft-capping and logit scaling included (an 8-bit
    KV cache within its rounding)."""
    hf = save_tiny(tiny(family), tmp_path)
    engine = Engine(EngineConfig(model=str(tmp_path), kv_cache_memory=1 << 22, block_size=4, model_impl="transformers",
                                 kv_cache_dtype=kv_cache_dtype))
    p = prompts(VOCAB, (23,), seed=5)[0]
    table = list(range(7))
    with torch.no_grad():
        ref = hf(torch.tensor([p + [7]])).logits[0]
    got = torch.cat([engine.runner.forward([ForwardItem(p, 0, table, len(p))]),
                     engine.runner.forward([ForwardItem([7], len(p), table, 1)])])
    tol = dict(rtol=1e-4, atol=1e-4) if kv_cache_dtype == "auto" else dict(rtol=0.05, atol=0.05)
    torch.testing.assert_close(got, ref, **tol)


def test_quantized_checkpoint_matches_its_transformers_forward(neox_dir, tmp_path):
    """A `compress quantize` rtn4 GPT-NeoX is served with its QuantLinear layers through the runtime's quantized
    kernels: dequantized weights give the greedy tokens of compress's own loader exactly; the packed kernels run."""
    from compress.config import load_recipe
    from compress.format.checkpoint import load_quantized
    from compress.job import quantize_to_folder

    out = quantize_to_folder(str(neox_dir[0]), load_recipe("rtn4").replace(group_size=32), str(tmp_path / "q"),
                             stream=False).out
    ref = load_quantized(out)
    ps = prompts(VOCAB, (6, 19, 3), seed=9)
    exact = Engine(EngineConfig(model=out, kv_cache_memory=1 << 22, quant_kernel="dequant", dtype="float32"))
    assert exact.runner.kernel_paths == {"dense": 4 * ref.config.num_hidden_layers + 1}  # and rtn4's int8 head
    assert [o.token_ids for o in exact.generate(ps, GREEDY)] == [hf_greedy(ref, p, N_NEW) for p in ps]
    packed = Engine(EngineConfig(model=out, kv_cache_memory=1 << 22))
    assert "dense" not in packed.runner.kernel_paths
    assert all(o.completion_tokens == N_NEW for o in packed.generate(ps, GREEDY))


def test_the_path_taken_is_logged(neox_dir, tmp_path, caplog):
    save_tiny("llama", tmp_path)
    with caplog.at_level(logging.INFO, logger="runtime.models.dispatch"):
        Engine(EngineConfig(model=str(tmp_path), kv_cache_memory=1 << 20))
        Engine(EngineConfig(model=str(neox_dir[0]), kv_cache_memory=1 << 20))
    assert [r.getMessage() for r in caplog.records if r.name == "runtime.models.dispatch"] == [
        "runtime: native llama model",
        "runtime: transformers backend for gpt_neox (slower)"]


def config_only_folder(path, config: dict):
    """A model folder with a config.json and a safetensors file holding no model weights: anything that got as
    far as reading weights would fail on it, so an error naming the model type comes before that."""
    from safetensors.torch import save_file

    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file({"not_a_weight": torch.zeros(1)}, str(path / "model.safetensors"))
    return str(path)


def test_unservable_models_are_refused_before_loading_weights(tmp_path):
    import transformers as tf

    cases = {
        "unknown": ({"model_type": "frobnicator", "hidden_size": 8}, "'frobnicator' is unknown to transformers"),
        "falcon": (tf.FalconConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=2).to_dict(),
                   "'falcon' cannot run on the runtime's paged KV cache.*_supports_attention_backend"),
        "t5": (tf.T5Config(d_model=64, num_layers=1, num_heads=4).to_dict(), "'t5' has no decoder-only"),
    }
    for name, (config, match) in cases.items():
        with pytest.raises(ValueError, match=match) as e:
            Engine(EngineConfig(model=config_only_folder(tmp_path / name, config), kv_cache_memory=1 << 20))
        assert "served natively: llama" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ValueError, match="gpt_neox"):
        neox = tiny("gpt_neox").to_dict()
        Engine(EngineConfig(model=config_only_folder(tmp_path / "neox", neox), model_impl="native"))
    with pytest.raises(ValueError, match="model_impl='fast'"):
        EngineConfig(model="x", model_impl="fast")


def test_remote_code_is_refused_without_trust_remote_code(tmp_path):
    """A model that needs its own Python code (auto_map) is refused with the flag to pass, and none of its code
    runs: neither its modeling file (it would write a marker) nor its config class."""
    marker = tmp_path / "ran"
    folder = tmp_path / "remote"
    config = {"model_type": "my_remote_lm", "hidden_size": 8,
              "auto_map": {"AutoConfig": "configuration_remote.RemoteConfig",
                           "AutoModelForCausalLM": "modeling_remote.RemoteForCausalLM"}}
    spec = config_only_folder(folder, config)
    for module in ("configuration_remote", "modeling_remote"):
        (folder / f"{module}.py").write_text(f"open({str(marker)!r}, 'w').write('{module}')\n")
    with pytest.raises(ValueError, match="'my_remote_lm' needs the checkpoint's own Python code.*--trust-remote-code"):
        Engine(EngineConfig(model=spec, kv_cache_memory=1 << 20))
    assert not marker.exists()


def test_config_adapter_reads_each_familys_names():
    """Head counts, head size and context come from each family's own config names (GPT-2's n_head/n_positions,
    GQA's num_key_value_heads, GPT-BigCode's multi_query)."""
    import transformers as tf

    gpt2 = TransformersConfig.from_hf(tf.GPT2Config(n_embd=64, n_layer=3, n_head=4, n_positions=128).to_dict())
    assert (gpt2.num_layers, gpt2.num_heads, gpt2.num_kv_heads, gpt2.head_dim, gpt2.max_position_embeddings) == \
        (3, 4, 4, 16, 128)
    sc2 = TransformersConfig.from_hf(tiny("starcoder2").to_dict())
    assert (sc2.num_heads, sc2.num_kv_heads, sc2.head_dim) == (4, 2, 16)
    mqa = TransformersConfig.from_hf(tf.GPTBigCodeConfig(n_embd=64, n_layer=2, n_head=4, multi_query=True).to_dict())
    assert (mqa.num_heads, mqa.num_kv_heads, mqa.head_dim) == (4, 1, 16)
