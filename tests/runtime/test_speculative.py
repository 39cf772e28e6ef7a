"""Speculative decoding: greedy output identical to plain decoding; rejection sampling keeps the target distribution."""
import pytest
import torch
from scipy.stats import chisquare

from runtime.config import EngineConfig
from runtime.engine import Engine
from runtime.sequence import SamplingParams
from runtime.speculative import NgramProposer, accept_greedy, accept_rejection
from tiny_engine import prompts, save_tiny

N_NEW = 16
GREEDY = SamplingParams(max_tokens=N_NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A tiny llama target (vocab 256, no tokenizer) and a draft: the target with noisy weights, so it
    agrees often but not always (both acceptance and rejection paths run)."""
    root = tmp_path_factory.mktemp("spec")
    target = save_tiny("llama", root / "target", seed=0, vocab=256)
    g = torch.Generator().manual_seed(9)
    with torch.no_grad():
        for p in target.parameters():
            p.mul_(1 + torch.randn(p.shape, generator=g) * 0.1)
    target.save_pretrained(root / "draft")
    return str(root / "target"), str(root / "draft")


def repetitive_prompts():
    """Prompts with repeats, so prompt lookup finds matches and drafts get accepted."""
    base = prompts(256, (6, 9, 4, 30), seed=1)
    return [base[0] * 3, base[1] + base[1][:5], base[2] * 6 + [7], base[3]]


def plain_outputs(target, ps, **kw):
    return [o.token_ids for o in Engine(EngineConfig(model=target, kv_cache_memory=1 << 22, **kw)).generate(ps, GREEDY)]


@pytest.mark.parametrize("draft", ["ngram", "model", "self"])
def test_greedy_speculation_is_token_identical(models, draft):
    target, draft_dir = models
    spec = {"ngram": "ngram", "model": draft_dir, "self": target}[draft]
    ps = repetitive_prompts()
    engine = Engine(EngineConfig(model=target, kv_cache_memory=1 << 22, draft=spec, num_speculative_tokens=3,
                                 block_size=4, prompt_lookup_min=1))
    outs = engine.generate(ps, GREEDY)
    assert [o.token_ids for o in outs] == plain_outputs(target, ps)
    s = engine.stats()
    assert s["spec_drafted"] > 0 and 0 < s["spec_accepted"] <= s["spec_drafted"]
    if draft == "self":  # the target drafting for itself is always right
        assert s["spec_accepted"] == s["spec_drafted"]
    assert s["kv_blocks_used"] == 0 and all(o.completion_tokens == N_NEW for o in outs)


@pytest.mark.parametrize("draft", ["ngram", "model"])
def test_speculation_under_preemption(models, draft):
    target, draft_dir = models
    ps = repetitive_prompts()
    engine = Engine(EngineConfig(model=target, num_kv_blocks=14, block_size=4, num_speculative_tokens=3, max_num_seqs=4,
                                 draft="ngram" if draft == "ngram" else draft_dir))
    outs = engine.generate(ps, GREEDY)
    assert [o.token_ids for o in outs] == plain_outputs(target, ps)
    assert engine.stats()["num_preemptions"] > 0
    assert engine.block_manager.num_free_blocks == 14


def test_speculation_respects_max_tokens_and_stop_ids(models):
    target, _ = models
    ps = repetitive_prompts()
    ref = plain_outputs(target, ps)
    engine = Engine(EngineConfig(model=target, kv_cache_memory=1 << 22, draft="ngram", num_speculative_tokens=4))
    outs = engine.generate(ps, SamplingParams(max_tokens=5, ignore_eos=True))
    assert [o.token_ids for o in outs] == [r[:5] for r in ref]
    stop = ref[0][6]
    out = engine.generate(ps[:1], SamplingParams(max_tokens=N_NEW, stop_token_ids=(stop,)))[0]
    assert out.token_ids == ref[0][:ref[0].index(stop) + 1] and out.finish_reason == "stop"


def test_sampled_speculation_runs_with_seeds(models):
    target, draft_dir = models
    params = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=N_NEW, ignore_eos=True, seed=3)
    engine = Engine(EngineConfig(model=target, kv_cache_memory=1 << 22, draft=draft_dir, num_speculative_tokens=3))
    a = engine.generate(repetitive_prompts()[:1], params)[0]
    b = engine.generate(repetitive_prompts()[:1], params)[0]
    assert a.token_ids == b.token_ids and len(a.token_ids) == N_NEW


def test_ngram_proposer():
    p = NgramProposer(1, 3)
    assert p.propose([1, 2, 3, 9, 1, 2, 3], 2) == [9, 1]  # longest suffix 1,2,3 seen before: continue it
    assert p.propose([5, 1, 2, 7, 1, 2], 3) == [7, 1, 2]
    assert p.propose([4, 8, 4, 5, 4], 2) == [5, 4]  # latest occurrence of the 1-gram wins
    assert p.propose([1, 2, 3], 2) == []
    assert NgramProposer(2, 3).propose([1, 9, 2, 1], 2) == []  # n_min=2: a 1-gram match is not enough


def test_accept_greedy():
    assert accept_greedy([4, 5, 6, 7], [4, 5, 6]) == [4, 5, 6, 7]
    assert accept_greedy([4, 9, 6, 7], [4, 5, 6]) == [4, 9]
    assert accept_greedy([3], []) == [3]


@pytest.mark.parametrize("point_mass", [False, True])
def test_rejection_sampling_keeps_the_target_distribution(point_mass):
    """The first and second emitted tokens follow p0 and p1 whatever the draft distribution is."""
    g = torch.Generator().manual_seed(0)
    vocab, trials = 5, 6000
    p = torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05], [0.1, 0.1, 0.2, 0.3, 0.3], [0.2, 0.2, 0.2, 0.2, 0.2]])
    q = torch.tensor([[0.1, 0.1, 0.6, 0.1, 0.1], [0.3, 0.3, 0.2, 0.1, 0.1]])
    first = torch.zeros(vocab)
    second = torch.zeros(vocab)
    for _ in range(trials):
        if point_mass:  # a prompt-lookup draft: fixed tokens, q is a point mass
            drafts, qq = [2, 0], None
        else:
            drafts = [int(torch.multinomial(q[i], 1, generator=g)) for i in range(2)]
            qq = q
        out = accept_rejection(p, drafts, qq, g)
        first[out[0]] += 1
        if out[0] == drafts[0]:  # the second token exists when the first draft was accepted
            second[out[1]] += 1
    for counts, probs in ((first, p[0]), (second, p[1])):
        result = chisquare(counts.numpy(), (probs * counts.sum()).numpy())
        assert result.pvalue > 1e-3, (counts, probs)
    # and the test can fail: the draft distribution itself is rejected
    assert chisquare(first.numpy(), (q[0] * first.sum()).numpy()).pvalue < 1e-6


@pytest.mark.parametrize("draft", ["model", "ngram"])
def test_sampled_speculation_matches_the_target_distribution(tmp_path, draft):
    """End to end (drafting, rejection sampling, bonus tokens, KV rollback in the engine): the joint
    distribution of the first three sampled tokens matches the target model's exact one (chi-square over
    4000 seeded requests; the first token comes from the prefill, the next two from one verification)."""
    vocab, n, temperature = 8, 4000, 1.5
    hf = save_tiny("llama", tmp_path / "t", seed=3, vocab=vocab, weight_std=0.3)
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for p in hf.parameters():
            p.mul_(1 + torch.randn(p.shape, generator=g) * 0.3)
    hf.save_pretrained(tmp_path / "d")
    hf = type(hf).from_pretrained(tmp_path / "t").eval()
    prompt = list(range(vocab)) * 2  # every token occurs earlier: prompt lookup always has a draft

    def next_probs(prefixes: torch.Tensor) -> torch.Tensor:  # [B, L] -> [B, vocab]
        with torch.no_grad():
            return (hf(prefixes).logits[:, -1] / temperature).softmax(-1)

    base = torch.tensor([prompt])
    joint = next_probs(base)[0]  # P(t1)
    for step in (1, 2):  # extend to P(t1, ..., t_{step+1}) over all prefixes
        tails = torch.cartesian_prod(*[torch.arange(vocab)] * step).reshape(-1, step)
        joint = (joint[:, None] * next_probs(torch.cat([base.expand(len(tails), -1), tails], 1))).flatten()
    engine = Engine(EngineConfig(model=str(tmp_path / "t"), kv_cache_memory=1 << 24, max_num_seqs=512,
                                 draft="ngram" if draft == "ngram" else str(tmp_path / "d"),
                                 num_speculative_tokens=2, prompt_lookup_min=1))
    outs = engine.generate([prompt] * n, [SamplingParams(temperature=temperature, max_tokens=3, ignore_eos=True,
                                                         seed=i) for i in range(n)])
    counts = torch.zeros(vocab ** 3)
    for o in outs:
        a, b, c = o.token_ids
        counts[(a * vocab + b) * vocab + c] += 1
    s = engine.stats()
    assert s["spec_drafted"] > 0 and 0 < s["spec_accepted"] < s["spec_drafted"]
    expected = joint * n
    keep = expected >= 5  # pool the rare cells into one
    obs = torch.cat([counts[keep], counts[~keep].sum()[None]])
    exp = torch.cat([expected[keep], expected[~keep].sum()[None]])
    assert chisquare(obs.numpy(), exp.numpy() * obs.sum().item() / exp.sum().item()).pvalue > 1e-3
