"""The runtime's RMSNorm and RoPE reproduce transformers' arithmetic bit for bit (fp32)."""
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
