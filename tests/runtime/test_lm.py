"""EngineLM scores windows through the serving runner: in fp32 its logits are transformers' (both paths)."""
import pytest
import torch

from runtime.lm import EngineLM
from tiny_engine import save_tiny


@pytest.mark.parametrize("mode", ["decode", "prefill"])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_engine_lm_logits_match_transformers(tmp_path, family, mode):
    hf = save_tiny(family, tmp_path)
    ids = torch.randint(3, hf.config.vocab_size, (5, 23), generator=torch.Generator().manual_seed(0))
    lm = EngineLM(str(tmp_path), dtype="float32", lm_head="fp", mode=mode, max_len=32, batch_size=2, block_size=8)
    with torch.no_grad():
        ref = hf(ids).logits
    torch.testing.assert_close(lm(ids).logits, ref, rtol=1e-4, atol=1e-4)


def test_engine_lm_refuses_long_windows_and_bad_modes(tmp_path):
    save_tiny("llama", tmp_path)
    with pytest.raises(ValueError, match="mode='sideways' is unknown"):
        EngineLM(str(tmp_path), mode="sideways")
    lm = EngineLM(str(tmp_path), dtype="float32", max_len=16)
    with pytest.raises(ValueError, match="exceed max_len=16"):
        lm(torch.zeros(1, 17, dtype=torch.long))
