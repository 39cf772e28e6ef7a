"""Speculative decoding under a grammar: greedy output with a JSON schema is token-identical with and without drafts
(prompt lookup, a draft model, the target drafting for itself), and walking a grammar state over drafts and back
leaves it where a fresh state fed the accepted tokens is."""
import json

import pytest
import torch

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

from live_server import char_tokenizer  # noqa: E402
from runtime import guided  # noqa: E402
from runtime.config import EngineConfig  # noqa: E402
from runtime.engine import Engine  # noqa: E402
from runtime.guided import Guides, GuideSpec  # noqa: E402
from runtime.sequence import SamplingParams, Sequence  # noqa: E402
from tiny_engine import save_tiny  # noqa: E402

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "pet": {"enum": ["cat", "dog", "none"]}},
          "required": ["name", "age", "pet"], "additionalProperties": False}
PROMPTS = ['{"name":"ann","age":31,"pet":"cat"} {"name":"bo","age":7,"pet":"dog"} ', "Who lives here? ",
           '{"name":"x","age":1,"pet":"none"}{"name":"x","age":1,"pet":"none"}']


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A tiny Llama with the character tokenizer, and a draft: the target with noisy weights."""
    root, tok = tmp_path_factory.mktemp("spec-guided"), char_tokenizer()
    target = save_tiny("llama", root / "target", tokenizer=tok, seed=0)
    g = torch.Generator().manual_seed(9)
    with torch.no_grad():
        for p in target.parameters():
            p.mul_(1 + torch.randn(p.shape, generator=g) * 0.1)
    target.save_pretrained(root / "draft")
    tok.save_pretrained(root / "draft")
    return str(root / "target"), str(root / "draft")


def engine_of(target, **kw):
    return Engine(EngineConfig(model=target, kv_cache_memory=1 << 22, block_size=4, max_model_len=256, **kw))


def schema_guide(engine):
    guides = Guides(engine.tokenizer, engine.runner.vocab_size, engine.eos_token_ids)
    return guides.compile(GuideSpec.json_schema(SCHEMA))


def guided_run(engine, checks_state: bool = False) -> list[list[int]]:
    """Greedy JSON-schema outputs of PROMPTS; ``checks_state``: after every step each running request's grammar
    state allows exactly what a fresh state fed its output allows."""
    params = SamplingParams(max_tokens=80, guide=schema_guide(engine))
    if not checks_state:
        return [o.token_ids for o in engine.generate(PROMPTS, params)]
    rids = [engine.add_request(p, params) for p in PROMPTS]
    seqs = [engine._live[r] for r in rids]
    while engine.has_unfinished():
        engine.step()
        for seq in seqs:
            if seq.guide_state is not None:
                vocab = engine.runner.vocab_size
                assert allowed(seq.guide_state, vocab) == allowed(fed(params.guide, seq.completion_token_ids), vocab)
    return [s.completion_token_ids for s in seqs]


def fed(guide, tokens: list[int]):
    state = guide.start()
    for t in tokens:
        state.advance(t)
    return state


def allowed(state, vocab: int) -> list[int]:
    logits = torch.zeros(1, vocab)
    guided.Guide.mask(logits, [0], [state])
    return torch.nonzero(logits[0] == 0).flatten().tolist()


@pytest.mark.parametrize("draft", ["ngram", "model", "self"])
def test_greedy_guided_speculation_is_token_identical(models, draft):
    target, draft_dir = models
    plain = guided_run(engine_of(target))
    spec = engine_of(target, draft={"ngram": "ngram", "model": draft_dir, "self": target}[draft],
                     num_speculative_tokens=3, prompt_lookup_min=1)
    outs = guided_run(spec, checks_state=True)
    assert outs == plain
    for o in outs:
        jsonschema.validate(json.loads(spec.tokenizer.decode(o, skip_special_tokens=True)), SCHEMA)
    s = spec.stats()
    assert s["spec_drafted"] > 0 and s["spec_accepted"] > 0
    if draft == "self":  # the target drafting for itself under the same grammar is always right
        assert s["spec_accepted"] == s["spec_drafted"]
    assert s["kv_blocks_used"] == 0


def test_sampled_guided_speculation_gives_valid_json(models):
    """Rejection sampling against masked rows: every output still follows the schema."""
    target, draft_dir = models
    engine = engine_of(target, draft=draft_dir, num_speculative_tokens=3)
    outs = engine.generate(PROMPTS, [SamplingParams(max_tokens=80, guide=schema_guide(engine), temperature=1.0, seed=i)
                                     for i in range(len(PROMPTS))])
    for o in outs:
        assert o.finish_reason == "stop"
        jsonschema.validate(json.loads(o.text), SCHEMA)
    assert engine.stats()["spec_drafted"] > 0


def test_walking_drafts_leaves_the_state_as_a_fresh_one_fed_the_accepted_tokens():
    tok = char_tokenizer()
    guide = Guides(tok, len(tok), (tok.eos_token_id,)).compile(GuideSpec.json_schema(SCHEMA))
    ids = tok('{"age": 4', add_special_tokens=False)["input_ids"]
    seq = Sequence("r", [0], SamplingParams(guide=guide))
    for t in ids[:3]:
        guided._state(seq).advance(t)
    drafts = ids[3:] + tok("x,", add_special_tokens=False)["input_ids"]  # "x" cannot follow a number here
    assert guided.accepted_drafts(seq, drafts) == len(ids) - 3
    assert allowed(seq.guide_state, len(tok)) == allowed(fed(guide, ids[:3]), len(tok))
    logits = torch.zeros(len(drafts) + 1, len(tok))
    guided.apply_to_drafts(logits, seq, drafts)
    for i in range(len(ids) - 3 + 1):  # row i: the state after drafts[:i]; rows past the refused draft unused
        assert torch.nonzero(logits[i] == 0).flatten().tolist() == allowed(fed(guide, ids[:3 + i]), len(tok))
    assert allowed(seq.guide_state, len(tok)) == allowed(fed(guide, ids[:3]), len(tok))
    walk = guided.DraftWalk()
    for t in drafts:
        walk.take(seq, t)
    assert walk.taken == {seq: len(ids) - 3} and walk.stopped == {seq}
    walk.undo()
    for t in ids[3:]:  # the engine then feeds what it accepted
        seq.guide_state.advance(t)
    assert allowed(seq.guide_state, len(tok)) == allowed(fed(guide, ids), len(tok))
