"""The runtime's RMSNorm and RoPE reproduce transformers' arithmetic (fp32): bit for bit for RMSNorm and rotary,
within fp32 rounding for scaled ropes (linear, llama3, LongRoPE, Gemma 3's per-layer-type rotaries, partial rotary)."""
import math

import pytest
import torch

from runtime.kernels.fused import TORCH_OPS
from runtime.models.layers import RMSNorm, Rotary, rope_inv_freq


@pytest.mark.parametrize("family", ["llama", "gemma"])
def test_rmsnorm_is_bit_identical(family):
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(7, 96, generator=gen) * 3
    w = torch.randn(96, generator=gen)
    ours = RMSNorm(96, 1e-6, offset=1.0 if family == "gemma" else 0.0)
    ref = GemmaRMSNorm(96, eps=1e-6) if family == "gemma" else LlamaRMSNorm(96, eps=1e-6)
    ours.weight.data.copy_(w)
    ref.weight.data.copy_(w)
    assert torch.equal(ours(x), ref(x))


def test_rope_is_bit_identical():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    gen = torch.Generator().manual_seed(1)
    q, k = torch.randn(5, 4, 16, generator=gen), torch.randn(5, 2, 16, generator=gen)  # [T, H, D]
    pos = torch.tensor([0, 3, 17, 40, 63])
    cos, sin = Rotary(16, 10000.0, None, 64)(pos, torch.float32)
    freqs = pos[:, None].float() * rope_inv_freq(16, 10000.0, None)[None, :]
    emb = torch.cat((freqs, freqs), -1)
    rq, rk = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], emb.cos()[None], emb.sin()[None])
    assert torch.equal(TORCH_OPS.rope(q, cos, sin, 4), rq[0].transpose(0, 1))
    assert torch.equal(TORCH_OPS.rope(k, cos, sin, 2), rk[0].transpose(0, 1))


@pytest.mark.parametrize("scaling", [
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
])
def test_rope_scaling_matches_transformers(scaling):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, rope_parameters={"rope_theta": 500000.0, **scaling})
    ref, _ = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](cfg, "cpu")
    torch.testing.assert_close(rope_inv_freq(16, 500000.0, scaling), ref, rtol=1e-6, atol=0)


def test_unsupported_rope_is_refused():
    with pytest.raises(ValueError, match="yarn"):
        rope_inv_freq(16, 10000.0, {"rope_type": "yarn", "factor": 2.0})


def _hf_cos_sin(rotary, positions, **kw):
    """transformers' rotary module's (cos, sin) ``[T, dim]`` for ``positions`` (fp32)."""
    cos, sin = rotary(torch.zeros(1), positions[None], **kw)
    return cos[0], sin[0]


def test_partial_rotary_matches_phi3():
    """Phi-3 rotates the first partial_rotary_factor of each head (rotate_half inside them), the rest passes."""
    from transformers import Phi3Config
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding, apply_rotary_pos_emb

    from runtime.models.layers import apply_rope

    cfg = Phi3Config(hidden_size=64, num_attention_heads=4, partial_rotary_factor=0.5)
    pos = torch.tensor([0, 3, 17, 40, 63])
    rot = Rotary(16, 10000.0, cfg.rope_parameters, 64)
    assert rot.dim == 8
    cos, sin = rot(pos, torch.float32)
    ref_cos, ref_sin = _hf_cos_sin(Phi3RotaryEmbedding(cfg), pos)
    assert torch.equal(cos[:, 0], ref_cos) and torch.equal(sin[:, 0].abs(), ref_sin.abs())
    gen = torch.Generator().manual_seed(2)
    qkv = torch.randn(5, 8, 16, generator=gen)  # [T, Hq + 2 Hkv, D]
    rq, rk = apply_rotary_pos_emb(qkv[:, :4].transpose(0, 1)[None], qkv[:, 4:6].transpose(0, 1)[None],
                                  ref_cos[None], ref_sin[None])
    out = apply_rope(TORCH_OPS, qkv.clone(), cos, sin, 6)
    assert torch.equal(out[:, :4], rq[0].transpose(0, 1)) and torch.equal(out[:, 4:], rk[0].transpose(0, 1))


def test_longrope_matches_phi3_below_and_past_the_original_length():
    """LongRoPE: short factors and the attention factor below original_max_position_embeddings, long factors
    past it (transformers switches a whole forward there; here each position, equal for a forward past it)."""
    from transformers import Phi3Config
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    from runtime.models.model_config import _rope

    gen = torch.Generator().manual_seed(3)
    short, long = (1 + torch.rand(4, generator=gen)).tolist(), (2 + 4 * torch.rand(4, generator=gen)).tolist()
    raw = dict(model_type="phi3", hidden_size=64, num_attention_heads=4, max_position_embeddings=256,
               original_max_position_embeddings=64, partial_rotary_factor=0.5,
               rope_scaling={"type": "longrope", "short_factor": short, "long_factor": long}, rope_theta=10000.0)
    params = _rope(raw, None)["default"]
    assert params["attention_factor"] == pytest.approx(math.sqrt(1 + math.log(4) / math.log(64)))
    hf_cfg = Phi3Config(**{k: v for k, v in raw.items() if k != "model_type"})
    rot = Rotary(16, 10000.0, params, 256)
    near, far = torch.arange(0, 64), torch.arange(64, 200)
    for pos in (near, far):
        ref_cos, ref_sin = _hf_cos_sin(Phi3RotaryEmbedding(hf_cfg), pos)
        cos, sin = rot(pos, torch.float32)
        torch.testing.assert_close(cos[:, 0], ref_cos, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(sin[:, 0, 4:], ref_sin[:, 4:], rtol=1e-6, atol=1e-6)


def test_gemma3_rotaries_per_layer_type_and_legacy_config_keys():
    """Gemma 3's sliding layers rotate with their local theta, global ones with the (scaled) global rope; a
    config.json in the older spelling (sliding_window_pattern, rope_local_base_freq, rope_scaling) reads the same."""
    from transformers import Gemma3TextConfig
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding

    from runtime.models.model_config import ModelConfig

    legacy = dict(model_type="gemma3_text", hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256, sliding_window=8,
                  sliding_window_pattern=6, rope_local_base_freq=10000.0, rope_theta=1e6,
                  rope_scaling={"rope_type": "linear", "factor": 8.0}, query_pre_attn_scalar=16)
    cfg = ModelConfig.from_hf(legacy)
    assert cfg.layer_types == ("sliding_attention",) * 5 + ("full_attention",)
    assert [cfg.window(i) for i in (0, 5)] == [8, None] and cfg.attn_scale == 0.25
    assert [cfg.rope_key(i) for i in (0, 5)] == ["sliding_attention", "full_attention"]
    hf = Gemma3RotaryEmbedding(Gemma3TextConfig(**{k: v for k, v in legacy.items() if k != "model_type"}))
    pos = torch.tensor([0, 5, 77, 200])
    for key, p in cfg.rope.items():
        cos, sin = Rotary(16, p["rope_theta"], p, 256)(pos, torch.float32)
        ref_cos, ref_sin = _hf_cos_sin(hf, pos, layer_type=key)
        torch.testing.assert_close(cos[:, 0], ref_cos, rtol=1e-6, atol=0)
        torch.testing.assert_close(sin[:, 0, 8:], ref_sin[:, 8:], rtol=1e-6, atol=0)
