"""Sampler filters and seeds; SamplingParams and EngineConfig validation."""
import pytest
import torch

from runtime.config import EngineConfig
from runtime.sampler import Sampler
from runtime.sequence import SamplingParams, Sequence


def seq(params: SamplingParams, rid: str = "r", n_prompt: int = 3) -> Sequence:
    return Sequence(rid, list(range(n_prompt)), params)


def test_greedy_and_filters():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [0.0, 0.0, 5.0, 4.9]])
    probs = Sampler.probs(logits, [SamplingParams(), SamplingParams(temperature=1.0, top_k=2)])
    assert probs[0].tolist() == [0.0, 1.0, 0.0, 0.0]  # greedy: one-hot on the argmax
    assert probs[1, :2].sum() == 0 and torch.isclose(probs[1].sum(), torch.tensor(1.0))
    # top_p keeps the smallest prefix of the sorted distribution whose mass reaches p
    p = Sampler.probs(torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])), [SamplingParams(temperature=1.0, top_p=0.7)])
    torch.testing.assert_close(p, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    # temperature sharpens
    t = Sampler.probs(logits[:1], [SamplingParams(temperature=0.1)])
    assert t[0, 1] > 0.99


def test_seeded_requests_are_reproducible_and_independent():
    sampler = Sampler(seed=0)
    logits = torch.zeros(2, 1000)
    a = [sampler.sample(logits[:1], [seq(SamplingParams(temperature=1.0, seed=5), "a")])[0] for _ in range(5)]
    sampler.release("a")
    pair = [seq(SamplingParams(temperature=1.0, seed=5), "a"), seq(SamplingParams(temperature=1.0), "x")]
    b = [sampler.sample(logits, pair)[0] for _ in range(5)]
    assert a == b and len(set(a)) > 1


def test_min_tokens_masks_eos_and_stop_ids():
    sampler = Sampler(seed=0, eos_token_ids=(2,))
    logits = torch.zeros(3, 8)
    logits[:, 2] = logits[:, 5] = 10.0
    s = seq(SamplingParams(min_tokens=2, stop_token_ids=(5,)))
    sampler.suppress_stops(logits, [s, s, s], [0, 1, 2])
    assert logits[0, 2] == logits[0, 5] == logits[1, 2] == float("-inf")
    assert logits[2, 2] == 10.0  # the third token may stop
    ignore = seq(SamplingParams(min_tokens=2, ignore_eos=True))
    row = torch.zeros(1, 8)
    sampler.suppress_stops(row, [ignore], [0])
    assert row[0, 2] == 0.0


@pytest.mark.parametrize("kwargs,match", [
    (dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"), (dict(top_k=-1), "top_k"),
    (dict(max_tokens=0), "max_tokens"), (dict(min_tokens=9, max_tokens=4), "min_tokens"), (dict(stop=("",)), "stop"),
])
def test_sampling_params_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_stop_string_is_normalized():
    assert SamplingParams(stop="###").stop == ("###",)


@pytest.mark.parametrize("kwargs,match", [
    (dict(block_size=0), "block_size"), (dict(num_kv_blocks=0), "num_kv_blocks"),
    (dict(max_num_seqs=0), "max_num_seqs"),
    (dict(dtype="int8"), "dtype"), (dict(device="tpu"), "device"), (dict(num_speculative_tokens=0), "num_speculative"),
    (dict(quant_kernel="fast"), "quant_kernel"), (dict(max_model_len=1), "max_model_len"), (dict(draft=""), "draft"),
])
def test_engine_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(model="m", **kwargs)


def test_engine_config_derived():
    assert EngineConfig(model="m").lookahead == 0
    assert EngineConfig(model="m", draft="ngram", num_speculative_tokens=3).lookahead == 3
