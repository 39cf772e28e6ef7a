"""Per-request sampling in the batched engine: n choices sharing the prompt's blocks, penalties, logit bias,
min_p, seeds independent of the batch, and logprobs (generated and prompt) against the model's own logits."""
import pytest
import torch

from runtime.config import EngineConfig
from runtime.engine import Engine
from runtime.sampler import Sampler
from runtime.sequence import SamplingParams, Sequence
from tiny_engine import prompts, save_tiny

VOCAB = 512


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    return str(path), save_tiny("llama", path, vocab=VOCAB, overrides={"max_position_embeddings": 1024})


def engine_for(path, **kw) -> Engine:
    return Engine(EngineConfig(model=path, kv_cache_memory=1 << 24, block_size=16, dtype="float32", **kw))


def peak_blocks(engine: Engine, prompt, params: list[SamplingParams]) -> tuple[int, dict]:
    ids = engine.add_choices(prompt, params, [f"c{i}" for i in range(len(params))])
    peak, toks = 0, {rid: [] for rid in ids}
    while engine.has_unfinished():
        for out in engine.step():
            toks[out.request_id] += out.new_token_ids
        peak = max(peak, engine.block_manager.num_used_blocks)
    return peak, toks


def test_n_choices_share_the_prompt_blocks(tiny):
    path, hf = tiny
    prompt = prompts(VOCAB, (512,), seed=3)[0]
    sampled = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
    one, _ = peak_blocks(engine_for(path, max_model_len=600), prompt, [sampled])
    engine = engine_for(path, max_model_len=600)
    four, toks = peak_blocks(engine, prompt, [SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, seed=i)
                                              for i in range(4)])
    assert four < 1.5 * one, (one, four)
    assert engine.stats()["prefix_cache_hit_tokens"] >= 3 * 496  # each later choice reused the first one's prompt
    assert len({tuple(t) for t in toks.values()}) > 1 and all(len(t) == 8 for t in toks.values())
    assert engine.block_manager.num_used_blocks == 0


def test_seeded_request_ignores_its_batch(tiny):
    path, _ = tiny
    ps = prompts(VOCAB, (9, 30, 4, 17), seed=1)
    seeded = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True, seed=77, top_p=0.9, min_p=0.05)
    alone = engine_for(path).generate([ps[0]], seeded)[0].token_ids
    noise = SamplingParams(temperature=1.0, max_tokens=14, ignore_eos=True)
    crowd = engine_for(path).generate(ps[1:] + [ps[0]], [noise] * 3 + [seeded])[-1].token_ids
    assert alone == crowd


def test_penalties_and_bias_change_the_logits_as_defined():
    logits = torch.tensor([[2.0, -1.0, 0.5, 0.0, 1.0]])
    s = Sequence("a", [0, 1], SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=2.0,
                                              logit_bias=((4, -3.0),)), num_prompt_tokens=1)
    s.token_ids += [2, 2]  # prompt [0], output [1, 2, 2]
    out = logits.clone()
    Sampler(0).process(out, [s], [0])
    # seen (prompt or output): 0, 1, 2 get the repetition penalty; output counts: 1 once, 2 twice
    expect = torch.tensor([[2.0 / 2, -1.0 * 2 - 0.25 - 0.5, 0.5 / 2 - 0.5 - 0.5, 0.0, 1.0 - 3.0]])
    torch.testing.assert_close(out, expect)


def test_min_p_drops_the_unlikely():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    p = Sampler.probs(logits, [SamplingParams(temperature=1.0, min_p=0.35)])
    torch.testing.assert_close(p, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))


def test_logit_bias_forces_a_token(tiny):
    path, _ = tiny
    out = engine_for(path).generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True, logit_bias={42: 100}))
    assert out[0].token_ids == [42] * 4


@pytest.mark.parametrize("chunk", [2048, 8])
def test_logprobs_equal_the_models_log_softmax(tiny, chunk):
    path, hf = tiny
    prompt = prompts(VOCAB, (21,), seed=5)[0]
    engine = engine_for(path, max_num_batched_tokens=chunk)
    rid = engine.add_request(prompt, SamplingParams(max_tokens=5, ignore_eos=True, logprobs=3, prompt_logprobs=2))
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.request_id == rid]
    tokens = sum((o.new_token_ids for o in outs), [])
    gen = sum((o.logprobs for o in outs), [])
    with torch.no_grad():
        ref = hf(torch.tensor([prompt + tokens])).logits[0].float().log_softmax(-1)
    full = prompt + tokens
    want_prompt = [ref[p, full[p + 1]].item() for p in range(len(prompt) - 1)]
    assert [e.token_id for e in outs[0].prompt_logprobs] == prompt[1:]
    torch.testing.assert_close(torch.tensor([e.logprob for e in outs[0].prompt_logprobs]), torch.tensor(want_prompt),
                               atol=1e-4, rtol=0)
    want_gen = [ref[len(prompt) - 1 + i, t].item() for i, t in enumerate(tokens)]
    assert [e.token_id for e in gen] == tokens and all(len(e.top) == 3 for e in gen)
    torch.testing.assert_close(torch.tensor([e.logprob for e in gen]), torch.tensor(want_gen), atol=1e-4, rtol=0)
    assert all(e.top[0][0] == e.token_id for e in gen)  # greedy: the chosen token is the top one


@pytest.mark.parametrize("kwargs,match", [
    (dict(presence_penalty=3), "presence_penalty"), (dict(repetition_penalty=0), "repetition_penalty"),
    (dict(min_p=1.5), "min_p"), (dict(logprobs=21), "logprobs"), (dict(logit_bias={3: 101}), "logit_bias"),
])
def test_new_sampling_params_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)
