"""Scaled rotary embeddings in GGUF: Llama 3.1/3.2's llama3 rope as llama.cpp's ``rope_freqs`` tensor and Phi-3.5 /
Phi-4-mini's longrope as ``rope_factors_long/short`` plus their keys, checked against transformers' own rope init,
read back through the gguf package, and (llama3) back through `compress eval FILE.gguf`'s loader."""
from __future__ import annotations

import pytest
import torch
from real_configs import load_all, tiny_config
from real_configs import build as build_real

from compress.exporters import gguf_arch
from compress.exporters.dispatch import export
from compress.exporters.gguf import GGUFOptions
from compress.format.families import FAMILIES

KIND = {r.id: (tiny_config(r).rope_parameters or {}).get("rope_type", "default") for r in load_all()}
SCALED = {r.id: r for r in load_all() if KIND[r.id] in ("llama3", "longrope")}


def _published(real):
    """The published config itself (full widths: Llama 3.1's 64 frequencies, not the tiny model's 8)."""
    from transformers import AutoConfig

    return AutoConfig.for_model(**real.config)


def _default_inv_freq(config) -> torch.Tensor:
    dim = gguf_arch.rotary_dim(config)
    theta = gguf_arch.rope_parameters(config)[0]["rope_theta"]
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def test_the_corpus_has_both_kinds():
    assert {KIND[r] for r in SCALED} == {"llama3", "longrope"} and len(SCALED) >= 4


@pytest.mark.parametrize("shrink", [False, True], ids=["published", "tiny"])
@pytest.mark.parametrize("rid", sorted(SCALED))
def test_rope_factors_are_transformers_rope(rid, shrink):
    """llama3: transformers' inverse frequencies are the plain ones divided by ``rope_freqs``; longrope: the short
    (up to the original context) and long factors divide them likewise, and the cos/sin scale is the attn_factor key."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    real = SCALED[rid]
    config = tiny_config(real) if shrink else _published(real)
    kind = gguf_arch.rope_parameters(config)[0]["rope_type"]
    tensors = gguf_arch.rope_tensors(config)
    keys = gguf_arch.rope_metadata(config, FAMILIES[real.model_type].gguf)
    base = _default_inv_freq(config)
    assert all(t.dtype == torch.float32 and t.shape == base.shape for t in tensors.values())
    if kind == "llama3":
        assert set(tensors) == {"rope_freqs.weight"} and "rope.scaling.type" not in keys  # as llama.cpp's converter
        want, _ = ROPE_INIT_FUNCTIONS["llama3"](config, None)
        factors = tensors["rope_freqs.weight"]
        torch.testing.assert_close(base / factors, want, rtol=1e-6, atol=0)
        factor = gguf_arch.rope_parameters(config)[0]["factor"]
        assert factors[0] == 1 and factors[-1] == factor  # fastest frequency kept, slowest slowed by the full factor
        assert ((factors > 1) & (factors < factor)).any()  # and a blended band between (every config here has one)
        return
    assert set(tensors) == {"rope_factors_long.weight", "rope_factors_short.weight"}
    params = gguf_arch.rope_parameters(config)[0]
    original = params["original_max_position_embeddings"]
    assert keys["rope.scaling.original_context_length"] == original
    for which, seq_len in (("short", original), ("long", original + 1)):
        assert tensors[f"rope_factors_{which}.weight"].tolist() == pytest.approx(params[f"{which}_factor"])
        want, attn = ROPE_INIT_FUNCTIONS["longrope"](config, None, seq_len)
        torch.testing.assert_close(base / tensors[f"rope_factors_{which}.weight"], want, rtol=1e-6, atol=0)
        assert keys["rope.scaling.attn_factor"] == pytest.approx(attn)


def test_llama3_factors_by_hand():
    """Llama 3.1's own numbers: theta 500000, factor 8, low/high 1/4, original 8192, 128-wide heads."""
    params = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    f = gguf_arch.llama3_rope_freqs(params, 500000.0, 128)
    wavelen = 2 * torch.pi * 500000.0 ** (torch.arange(0, 128, 2, dtype=torch.float64) / 128)
    assert (f[wavelen < 2048] == 1).all() and (f[wavelen > 8192] == 8).all()
    mid = (wavelen >= 2048) & (wavelen <= 8192)
    assert mid.any() and ((f[mid] >= 1) & (f[mid] <= 8)).all() and (f[mid].diff() >= 0).all()


def test_unreadable_combinations_are_refused():
    from transformers import LlamaConfig, Qwen2Config

    llama3 = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192}
    qwen = Qwen2Config(hidden_size=64, num_attention_heads=4, rope_parameters=llama3)
    with pytest.raises(ValueError, match="'qwen2' architecture does not read llama3"):
        gguf_arch.hparams(qwen, FAMILIES["qwen2"].gguf)
    yarn = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 4096}
    with pytest.raises(ValueError, match="rope_type 'yarn'"):
        gguf_arch.rope_metadata(LlamaConfig(hidden_size=64, num_attention_heads=4, rope_parameters=yarn))
    phi = tiny_config(SCALED["phi3/microsoft--Phi-3.5-mini-instruct"])
    phi.rope_parameters = {**phi.rope_parameters, "short_factor": phi.rope_parameters["short_factor"][:-1]}
    with pytest.raises(ValueError, match="short_factor must list 8 factors"):
        gguf_arch.rope_tensors(phi)


@pytest.fixture
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("COMPRESS_CACHE", str(tmp_path / "cache"))  # load_model caches dequantized GGUFs


@pytest.mark.parametrize("rid", sorted(SCALED))
def test_gguf_carries_the_rope_factors(rid, tmp_path):
    gguf = pytest.importorskip("gguf")
    real = SCALED[rid]
    build_real(real, tmp_path / "fp")
    path = export(str(tmp_path / "fp"), "gguf", tmp_path / "m.gguf", options=GGUFOptions(embed_type="f32"))
    reader = gguf.GGUFReader(path)
    arch = FAMILIES[real.model_type].gguf.name
    fields = {k: f.contents() for k, f in reader.fields.items()}
    tensors = {t.name: t for t in reader.tensors}
    config = tiny_config(real)
    for name, want in gguf_arch.rope_tensors(config).items():
        assert tensors[name].tensor_type.name == "F32" and tuple(tensors[name].shape) == (len(want),)
        assert torch.from_numpy(tensors[name].data.copy()).tolist() == want.tolist()
    assert fields[f"{arch}.rope.dimension_count"] == gguf_arch.rotary_dim(config)
    assert fields[f"{arch}.context_length"] == config.max_position_embeddings
    if arch == "phi3":
        assert {"rope_factors_long.weight", "rope_factors_short.weight"} <= set(tensors)
        assert fields["phi3.rope.scaling.original_context_length"] == 4096
        assert fields["phi3.rope.scaling.attn_factor"] == pytest.approx(gguf_arch.longrope_attn_factor(
            config, gguf_arch.rope_parameters(config)[0]), rel=1e-6)
    else:
        assert "rope_freqs.weight" in tensors and f"{arch}.rope.scaling.type" not in fields


@pytest.mark.usefixtures("_private_cache")
@pytest.mark.parametrize("rid", sorted(r for r in SCALED if KIND[r] == "llama3"))
def test_llama3_gguf_logits_through_compress_eval_loader(tmp_path, rid):
    """transformers' GGUF reader drops ``rope_freqs``; the loader (`compress eval FILE.gguf`, quantize and serve from a
    GGUF) reads it back as llama3 rope parameters, so the loaded model's logits are the checkpoint's."""
    from compress.format.models import load_model

    from .gguf_models import bpe_tokenizer

    model = build_real(SCALED[rid], tmp_path / "fp")
    bpe_tokenizer().save_pretrained(tmp_path / "fp")  # transformers' GGUF tokenizer reader needs BPE merges
    path = export(str(tmp_path / "fp"), "gguf", tmp_path / "m.gguf", options=GGUFOptions(embed_type="f32"))
    back, _, _ = load_model(str(path))
    assert back.config.rope_parameters["rope_type"] == "llama3"
    ids = torch.randint(3, 256, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, model(ids).logits, rtol=0, atol=1e-4)


@pytest.mark.parametrize("rid", sorted(r for r in SCALED if KIND[r] == "llama3"))
def test_llama3_parameters_from_factors_reproduce_the_factors(rid):
    """The published (full-width) factors and the tiny model's both come back from the recovered parameters."""
    from compress.format.gguf_dequant import llama3_rope_from_factors

    for config in (_published(SCALED[rid]), tiny_config(SCALED[rid])):
        params, _ = gguf_arch.rope_parameters(config)
        theta, dim = params["rope_theta"], gguf_arch.rotary_dim(config)
        factors = gguf_arch.llama3_rope_freqs(params, theta, dim)
        back = llama3_rope_from_factors(factors, theta)
        torch.testing.assert_close(gguf_arch.llama3_rope_freqs(back, theta, dim), factors, rtol=1e-5, atol=0)
