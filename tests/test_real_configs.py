"""Tiny models built from published checkpoints' configs (tests/configs, shrunk by tests/real_configs.py) through
every step: the shrink keeps every setting, quantizing streamed gives the in-memory bits (rtn4 and a calibrated
recipe, gptq4 and awq4 alternating), the engine's greedy tokens equal transformers' on the quantized folder, and the
folder exports to the formats compress/format/families.py allows for the family (ONNX aside: a trace per config is
5-10 s, which tests/compress/exporters/test_families.py spends once per family)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from real_configs import ID_KEYS, KEPT_IDS, SMALL_VOCAB, build, load_all, remap_id, shrunk, tiny_config
from tiny_models import TINY_RECIPE, one_thread

from compress.format.families import FAMILIES, supports

REALS = load_all()
# gptq4 and awq4 alternate, but the tiny models 448 wide (Qwen's 7 query heads per KV head) take awq4: GPTQ's
# Hessian work on their 2,400-wide MLPs is 10-15 s a config, a third of the whole file's budget
_NARROW = [r for r in REALS if shrunk(r)["hidden_size"] <= 256]
CALIBRATED = {r.id: ("gptq4", "awq4")[_NARROW.index(r) % 2] if r in _NARROW else "awq4" for r in REALS}
# what shrinking may change; every other key of the published config is kept as it is
SIZES = {"hidden_size", "intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size",
         "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "query_pre_attn_scalar",
         "num_experts", "num_local_experts", "num_experts_per_tok", "vocab_size", "layer_types", "mlp_only_layers",
         "rope_scaling", "_name_or_path", *ID_KEYS}


def _params(reals):
    return [pytest.param(r, id=r.id) for r in reals]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with one_thread():
        yield


@pytest.fixture(scope="module")
def folders(tmp_path_factory, calib_text):
    """folders(real, recipe=None, stream=True) -> the tiny model's folder (recipe None) or its quantized folder,
    built once."""
    from compress.config import load_recipe
    from compress.job import quantize_to_folder

    cache = {}

    def get(real, recipe: str | None = None, stream: bool = True) -> Path:
        key = (real.id, recipe, stream)
        if key not in cache:
            if recipe is None:
                path = tmp_path_factory.mktemp("src") / real.name
                build(real, path)
            else:
                cfg = load_recipe(recipe).replace(**{**TINY_RECIPE, "seqlen": 32, "calib": str(calib_text)})
                if cfg.method == "gptq":  # its MSE grid search is per-matrix maths (test_gptq.py), 3x the time here
                    cfg = cfg.replace(mse=False)
                path = tmp_path_factory.mktemp("q") / f"{real.name}-{recipe}-{'stream' if stream else 'memory'}"
                assert quantize_to_folder(str(get(real)), cfg, str(path), stream=stream).streamed == stream
            cache[key] = path
        return cache[key]

    return get


def test_the_corpus_covers_every_family_twice():
    have = {t: sum(r.model_type == t for r in REALS) for t in FAMILIES}
    assert all(n >= 2 for n in have.values()), have


@pytest.mark.parametrize("real", _params(REALS))
def test_the_tiny_config_keeps_every_setting(real):
    """Only sizes change: every other key is the published value, special ids keep their distance from the
    vocabulary's end (or their small value), and transformers' rope parameters are the published ones."""
    from transformers import AutoConfig

    pub, small = real.config, shrunk(real)
    assert {k: small.get(k) for k in pub if k not in SIZES} == {k: v for k, v in pub.items() if k not in SIZES}
    vocab = pub["vocab_size"]
    for k in ID_KEYS:
        for old, new in zip(*(v if isinstance(v, list) else [v] for v in (pub.get(k), small.get(k)))):
            if new is not None:  # a small id kept, or one as far from the vocabulary's end as it was
                assert 0 <= new < SMALL_VOCAB and (new == old < KEPT_IDS or SMALL_VOCAB - new == vocab - old)
    tiny = tiny_config(real)
    full = AutoConfig.for_model(real.model_type, **{k: v for k, v in pub.items() if k != "model_type"})
    keep = ("rope_type", "rope_theta", "factor", "low_freq_factor", "high_freq_factor",
            "original_max_position_embeddings")

    def rope(c):
        p = c.rope_parameters or {}
        by_kind = p if all(isinstance(v, dict) for v in p.values()) else {"": p}
        return {kind: {k: v.get(k) for k in keep} for kind, v in by_kind.items()}

    assert rope(tiny) == rope(full)
    assert tiny.tie_word_embeddings == full.tie_word_embeddings
    assert getattr(tiny, "layer_types", None) is None or set(tiny.layer_types) == set(full.layer_types)


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    from compress.format.shards import shard_files

    out = {}
    for f in shard_files(folder):
        out.update(load_file(str(f)))
    return out


@pytest.mark.parametrize("kind", ["rtn4", "calibrated"])
@pytest.mark.parametrize("real", _params(REALS))
def test_streamed_equals_in_memory(folders, real, kind):
    recipe = CALIBRATED[real.id] if kind == "calibrated" else kind
    a, b = _tensors(folders(real, recipe, stream=True)), _tensors(folders(real, recipe, stream=False))
    assert a.keys() == b.keys()
    assert [k for k in a if not torch.equal(a[k], b[k])] == []


@pytest.mark.parametrize("real", _params(REALS))
def test_engine_greedy_matches_transformers(folders, real):
    """The runtime serves the streamed rtn4 folder with the greedy tokens of the same folder loaded into
    transformers by compress's loader (dequantizing kernels, fp32: the same numbers)."""
    from compress.format.checkpoint import load_quantized
    from runtime.config import EngineConfig
    from runtime.engine import Engine
    from runtime.sequence import SamplingParams

    out = folders(real, "rtn4")
    ref = load_quantized(out)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, KEPT_IDS, (n,), generator=g).tolist() for n in (5, 19)]
    expected = []
    for p in prompts:
        ids = ref.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long), max_new_tokens=8,
                           min_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
        expected.append(ids[0, len(p):].tolist())
    engine = Engine(EngineConfig(model=str(out), kv_cache_memory=1 << 22, quant_kernel="dequant", dtype="float32"))
    got = engine.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
    assert [o.token_ids for o in got] == expected


def _per_linear(model_type: str) -> list[str]:
    return ["compressed-tensors", "gptq", "awq"] if FAMILIES[model_type].experts is None else []


@pytest.mark.parametrize("real", _params(r for r in REALS if _per_linear(r.model_type)))
def test_per_linear_exports(folders, real, tmp_path):
    """compressed-tensors, gptq and awq write the tiny model's ids; compressed-tensors loads in transformers with
    compress's logits (tests/compress/exporters/test_families.py decodes the other two)."""
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    from compress.exporters.dispatch import export
    from compress.format.checkpoint import load_quantized

    src = folders(real, CALIBRATED[real.id])
    tiny = tiny_config(real)
    head = json.loads((src / "config.json").read_text())["quantization_config"].get("head") or {}
    for fmt in _per_linear(real.model_type):
        if fmt == "awq" and head and not head["tied"] and head["bits"] != 4:  # the recipes' untied int8 head
            with pytest.raises(ValueError, match="--head none"):  # AWQ's GEMM layout is 4-bit only
                export(str(src), fmt, tmp_path / fmt)
            continue
        out = export(str(src), fmt, tmp_path / fmt, dequantize_embedding=True)  # the recipes' int8 table
        cfg = json.loads((out / "config.json").read_text())
        assert {k: cfg.get(k) for k in ID_KEYS} == {k: getattr(tiny, k, None) for k in ID_KEYS}
    if head and not head["tied"] and head["bits"] == 8:
        # transformers' compressed-tensors loader dequantizes 4-bit packed weights only (the 8-bit head is checked
        # 8-bit packed weights are decompressed bit for bit by the compressed_tensors library in
        # tests/compress/exporters/test_compressed_tensors.py)
        return
    ids = torch.randint(3, KEPT_IDS, (1, 12), generator=torch.Generator().manual_seed(3))
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "compressed-tensors",
                                                  quantization_config=CompressedTensorsConfig(dequantize=True))
    with torch.no_grad():
        got, ref = theirs.eval()(ids).logits, load_quantized(src)(ids).logits
    assert float((got - ref).abs().max() / ref.abs().max()) <= 1e-5


def _gguf_params():
    return _params(r for r in REALS if supports(r.model_type, "gguf"))


@pytest.mark.parametrize("real", _gguf_params())
def test_gguf_export(folders, real, tmp_path):
    """The GGUF names the family's llama.cpp architecture and carries the tiny model's special ids, and its rope
    scaling's per-frequency factors (llama3: ``rope_freqs``; longrope: ``rope_factors_long/short``)."""
    from compress.exporters.dispatch import export
    from compress.exporters.gguf_arch import rope_tensors

    gguf = pytest.importorskip("gguf")
    out = export(str(folders(real, CALIBRATED[real.id])), "gguf", tmp_path / "m.gguf")
    reader = gguf.GGUFReader(str(out))
    fields = {k: f.contents() for k, f in reader.fields.items()}
    assert set(rope_tensors(tiny_config(real))) <= {t.name for t in reader.tensors}
    assert fields["general.architecture"] == FAMILIES[real.model_type].gguf.name
    tiny = tiny_config(real)
    for k, key in (("bos_token_id", "tokenizer.ggml.bos_token_id"),
                   ("pad_token_id", "tokenizer.ggml.padding_token_id")):
        if isinstance(getattr(tiny, k, None), int) and key in fields:
            assert fields[key] == getattr(tiny, k)


def _windowed(real) -> int | None:
    """The published sliding window when some layer uses it and it is short enough to cross here."""
    tiny = tiny_config(real)
    window, types = getattr(tiny, "sliding_window", None), getattr(tiny, "layer_types", None)
    if window and window <= 4096 and (types is None or "sliding_attention" in types):  # no types: every layer
        return window
    return None


def _window_params():
    for r in REALS:
        if _windowed(r):  # a 4,120-token prompt (Gemma 2) is 15-20 s of fp32 reference here: slow
            yield pytest.param(r, id=r.id, marks=pytest.mark.slow if _windowed(r) > 1024 else ())


@pytest.mark.parametrize("real", _window_params())
def test_engine_crosses_the_published_sliding_window(folders, real):
    """A prompt past the published window (Gemma 3's 512; Gemma 2's and DictaLM's 4,096 in the slow run): the engine's
    sliding layers attend to the last ``sliding_window`` positions as transformers' do, its full layers to all."""
    from compress.format.checkpoint import load_quantized
    from runtime.config import EngineConfig
    from runtime.engine import Engine
    from runtime.sequence import SamplingParams

    out = folders(real, "rtn4")
    ref = load_quantized(out)
    p = torch.randint(3, KEPT_IDS, (_windowed(real) + 24,), generator=torch.Generator().manual_seed(7)).tolist()
    ids = ref.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long), max_new_tokens=4,
                       min_new_tokens=4, do_sample=False, eos_token_id=None, pad_token_id=0)
    engine = Engine(EngineConfig(model=str(out), kv_cache_memory=1 << 26, quant_kernel="dequant", dtype="float32"))
    got = engine.generate([p], SamplingParams(max_tokens=4, ignore_eos=True))[0].token_ids
    assert got == ids[0, len(p):].tolist()
