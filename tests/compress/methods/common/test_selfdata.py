import types

import pytest
import torch
from tiny_models import FAMILIES, one_thread, tiny_model

from compress.config import QATOptions
from compress.methods import qat
from compress.methods.common import selfdata


def _reference(model, n, seqlen, seed):
    """The same sampling with a full forward pass per token (no KV cache), in fp32."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.full((n, seqlen), selfdata.start_token(model.config), dtype=torch.long)
    with torch.no_grad():
        for t in range(1, seqlen):
            probs = torch.softmax(model(input_ids=ids[:, :t]).logits[:, -1].float(), dim=-1)
            ids[:, t] = torch.multinomial(probs, 1, generator=gen).squeeze(1)
    return ids


@pytest.mark.parametrize("family", FAMILIES)
def test_cached_sampling_equals_sampling_without_a_cache(family):
    model = tiny_model(family)
    if model.config.bos_token_id is None and model.config.eos_token_id is None:
        model.config.eos_token_id = 7  # Qwen's tiny configs leave both unset; its real checkpoints declare them
    with one_thread():
        got = selfdata.sample_windows(model, 3, 12, seed=5)
        assert torch.equal(got, _reference(model, 3, 12, seed=5))
    assert got.shape == (3, 12) and got.dtype == torch.long
    assert (got[:, 0] == selfdata.start_token(model.config)).all()
    assert 0 <= got.min() and got.max() < model.config.vocab_size
    with one_thread():  # windows are sampled batch by batch: the first batch is a run of its own
        assert torch.equal(selfdata.sample_windows(model, 3, 12, seed=5, batch_size=2)[:2],
                           _reference(model, 2, 12, seed=5))


def test_samples_follow_the_models_distribution():
    model = tiny_model("llama")
    with torch.no_grad():  # a peaked first-token distribution, so that frequencies are measurable
        model.lm_head.weight.mul_(40)
        ids = torch.tensor([[selfdata.start_token(model.config)]])
        p = torch.softmax(model(input_ids=ids).logits[0, -1], dim=-1)
    with one_thread():
        first = selfdata.sample_windows(model, 4000, 2, seed=0, batch_size=4000)[:, 1]
    freq = torch.bincount(first, minlength=p.numel()).float() / first.numel()
    assert p.max() > 0.2  # the check below means something
    assert (freq - p).abs().max() < 0.03


def test_same_seed_same_windows_other_seed_other_windows():
    model = tiny_model("mistral")
    with one_thread():
        a, b, c = (selfdata.sample_windows(model, 2, 10, seed=s) for s in (0, 0, 1))
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert not model.training


def test_start_token_falls_back_to_eos_and_refuses_a_model_with_neither():
    cfg = types.SimpleNamespace
    assert selfdata.start_token(cfg(bos_token_id=7, eos_token_id=2)) == 7
    assert selfdata.start_token(cfg(bos_token_id=None, eos_token_id=[5, 6])) == 5
    with pytest.raises(ValueError, match="neither bos_token_id nor eos_token_id.*self_data: 0"):
        selfdata.start_token(cfg(model_type="x", bos_token_id=None, eos_token_id=None))


def test_with_self_data_replaces_the_last_share_of_the_windows():
    model = tiny_model("llama")
    ids = torch.randint(3, 256, (8, 6), generator=torch.Generator().manual_seed(0))
    same, seconds = qat.with_self_data(ids, model, 0.0, 0)
    assert same is ids and seconds == 0.0
    with one_thread():
        mixed, seconds = qat.with_self_data(ids, model, 0.5, 0)
    assert mixed.shape == ids.shape and seconds > 0
    assert torch.equal(mixed[:4], ids[:4])
    assert (mixed[4:, 0] == selfdata.start_token(model.config)).all()


@pytest.mark.parametrize("share", [-0.1, 1.0])
def test_a_share_outside_0_1_is_refused(share):
    with pytest.raises(ValueError, match=r"self_data=.*\[0, 1\)"):
        QATOptions(self_data=share)


def test_progress_counts_windows():
    seen = []
    with one_thread():
        selfdata.sample_windows(tiny_model("llama"), 5, 4, batch_size=2, progress=lambda *a: seen.append(a))
    assert seen == [(2, 5, "window"), (4, 5, "window"), (5, 5, "window")]


def test_a_model_without_a_start_token_is_refused_before_its_weights_load(tmp_path):
    from compress.config import load_recipe
    from compress.job import quantize_to_folder

    src = tmp_path / "qwen2"
    tiny_model("qwen2").config.save_pretrained(src)  # a config only: loading weights would fail otherwise
    cfg = load_recipe("rot-qat4").replace(self_data=0.5)
    with pytest.raises(ValueError, match="qwen2 declares neither bos_token_id nor eos_token_id"):
        quantize_to_folder(str(src), cfg, str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()
