"""Structured output: the grammar masks against a brute-force check on a tiny vocabulary, and JSON-schema, JSON,
regex and choice outputs from a tiny random model through the real `openai` client that parse and validate."""
import itertools
import json
import re

import openai
import pytest
import torch

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

from runtime.config import EngineConfig  # noqa: E402
from runtime.engine import Engine  # noqa: E402
from runtime.guided import Guides, GuideSpec  # noqa: E402
from runtime.sequence import SamplingParams  # noqa: E402
from test_server import KEY, Served, model_dir  # noqa: E402,F401 (fixtures)

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                      "tags": {"type": "array", "items": {"type": "string", "maxLength": 4},
                                               "maxItems": 3}},
     "required": ["color", "tags"], "additionalProperties": False},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": -5, "maximum": 5}, "y": {"type": "boolean"}},
        "required": ["x", "y"], "additionalProperties": False}}, "required": ["point"], "additionalProperties": False},
]


def multi_char_tokenizer():
    """The one-character tokenizer plus tokens of several characters, so a token can overshoot a word's end."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"]
    pieces = ["\n"] + [chr(c) for c in range(32, 127)] + ["ye", "yes!", "may", "mayb", "day", "ab", "b1", "9c", "no"]
    tk = Tokenizer(models.WordLevel({c: i for i, c in enumerate(specials + pieces)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tk.decoder = decoders.Fuse()
    tk.add_special_tokens([AddedToken(t, special=True) for t in specials])
    return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token=specials[0], eos_token=specials[2],
                                   pad_token=specials[0], unk_token=specials[3])


@pytest.fixture(scope="module")
def guides():
    tok = multi_char_tokenizer()
    return tok, Guides(tok, len(tok), (tok.eos_token_id,))


def mask_of(guide, state, vocab: int) -> set[int]:
    logits = torch.zeros(1, vocab)
    guide.mask(logits, [0], [state])
    return set(torch.nonzero(logits[0] == 0).flatten().tolist())


@pytest.mark.parametrize("spec,language", [
    (GuideSpec.choice(["yes", "no", "maybe", "mayday"]), {"yes", "no", "maybe", "mayday"}),
    (GuideSpec("regex", r"(ab|b)[0-9]c?"),
     {"".join(p) for n in range(1, 5) for p in itertools.product("abc0123456789", repeat=n)
      if re.fullmatch(r"(ab|b)[0-9]c?", "".join(p))}),
])
def test_mask_equals_brute_force(guides, spec, language):
    """At every prefix of the language, a token is allowed iff prefix + token still begins a word of it, and EOS
    iff the prefix is a word."""
    tok, g = guides
    guide, vocab = g.compile(spec), len(tok)
    text = {t: tok.decode([t]) for t in range(vocab) if t not in tok.all_special_ids}
    for word in sorted(language):
        state = guide.start()
        for i in range(len(word) + 1):
            prefix = word[:i]
            want = {t for t, s in text.items() if any(w.startswith(prefix + s) for w in language)}
            want |= {tok.eos_token_id} if prefix in language else set()
            assert mask_of(guide, state, vocab) == want, prefix
            if i < len(word):
                state.advance(tok.convert_tokens_to_ids(word[i]))


def test_compiled_grammars_are_cached_and_bad_ones_refused(guides):
    _, g = guides
    a = g.compile(GuideSpec.json_schema(SCHEMAS[0]))
    assert g.compile(GuideSpec.json_schema(json.dumps(SCHEMAS[0]))) is a and g.hits >= 1
    with pytest.raises(ValueError, match="does not compile"):
        g.compile(GuideSpec("regex", "(unclosed"))
    with pytest.raises(ValueError, match="not valid JSON"):
        GuideSpec.json_schema("{nope")


@pytest.fixture(scope="module")
def served(model_dir):  # noqa: F811
    engine = Engine(EngineConfig(model=str(model_dir), max_model_len=256, kv_cache_memory=8 << 20, block_size=16))
    s = Served(engine, model_name="tiny", api_key=KEY)
    yield s
    s.close()


@pytest.mark.parametrize("i", range(len(SCHEMAS)))
def test_json_schema_outputs_validate(served, i):
    c = served.client()
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMAS[i], "strict": True}}
    for seed in range(3):
        r = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "give JSON"}],
                                      response_format=fmt, max_tokens=150, temperature=1.0, seed=seed)
        assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
        jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMAS[i])
    chunks = list(c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "JSON"}], stream=True,
                                            response_format=fmt, max_tokens=150, temperature=1.0, seed=9))
    jsonschema.validate(json.loads("".join(ch.choices[0].delta.content or "" for ch in chunks)), SCHEMAS[i])


def test_json_object_regex_and_choice(served):
    c = served.client()
    r = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=150,
                                  response_format={"type": "json_object"}, temperature=0.7, seed=1)
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    r = c.completions.create(model="tiny", prompt="id:", max_tokens=20, temperature=1.0, seed=2,
                             extra_body={"guided_regex": r"[A-Z]{2}-[0-9]{3}"})
    assert re.fullmatch(r"[A-Z]{2}-[0-9]{3}", r.choices[0].text)
    r = c.completions.create(model="tiny", prompt="answer:", max_tokens=20, n=4, temperature=1.0, seed=3,
                             extra_body={"structured_outputs": {"choice": ["alpha", "beta", "gamma"]}})
    assert {ch.text for ch in r.choices} <= {"alpha", "beta", "gamma"}
    ebnf = 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?'
    r = c.completions.create(model="tiny", prompt="sum:", max_tokens=40, temperature=1.0, seed=4,
                             extra_body={"guided_grammar": ebnf})
    assert re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)", r.choices[0].text), r.choices[0].text


def test_bad_requests_and_length(served):
    c = served.client()
    bad = {"type": "object", "properties": {"a": {"type": "strnig"}}}
    with pytest.raises(openai.BadRequestError, match="response_format"):
        c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=5,
                                  response_format={"type": "json_schema", "json_schema": {"name": "b", "schema": bad}})
    with pytest.raises(openai.BadRequestError, match="guided_regex"):
        c.completions.create(model="tiny", prompt="x", max_tokens=5, extra_body={"guided_regex": "(unclosed"})
    with pytest.raises(openai.BadRequestError, match="guided_choice and guided_regex|guided_regex and guided_choice"):
        c.completions.create(model="tiny", prompt="x", max_tokens=5,
                             extra_body={"guided_regex": "a", "guided_choice": ["a"]})
    r = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=3,
                                  response_format={"type": "json_schema",
                                                   "json_schema": {"name": "s", "schema": SCHEMAS[0]}})
    assert r.choices[0].finish_reason == "length" and r.choices[0].message.content.startswith('{"')


def test_aborted_request_drops_its_grammar_state(model_dir):  # noqa: F811
    engine = Engine(EngineConfig(model=str(model_dir), max_model_len=256, kv_cache_memory=8 << 20))
    guide = Guides(engine.tokenizer, engine.runner.vocab_size, engine.eos_token_ids).compile(GuideSpec("regex", "[a-z]{40}"))
    rid = engine.add_request("x", SamplingParams(max_tokens=60, guide=guide, temperature=1.0))
    seq = engine._live[rid]
    engine.step(), engine.step()
    assert seq.guide_state is not None and seq.num_completion_tokens == 2
    engine.abort(rid)
    engine.step()
    assert seq.guide_state is None and engine.block_manager.num_used_blocks == 0


def test_unbounded_numbers_get_the_safe_range_so_every_output_can_end():
    from runtime.guided import SAFE_INTEGER, bounded

    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "x": {"type": ["number", "null"]},
                                                "k": {"type": "integer", "minimum": 3, "exclusiveMaximum": 9},
                                                "a": {"type": "array", "items": {"type": "integer"}}}}
    b = bounded(schema)
    assert b["properties"]["n"] == {"type": "integer", "minimum": -SAFE_INTEGER, "maximum": SAFE_INTEGER}
    assert b["properties"]["x"]["maximum"] == SAFE_INTEGER and b["properties"]["a"]["items"]["minimum"] == -SAFE_INTEGER
    assert b["properties"]["k"] == {"type": "integer", "minimum": 3, "exclusiveMaximum": 9}  # its own bounds kept
    assert schema["properties"]["n"] == {"type": "integer"}  # the request's schema is not changed


def test_an_unbounded_integer_cannot_run_past_sixteen_digits(guides):
    tok, g = guides
    guide = g.compile(GuideSpec.json_schema({"type": "integer"}))
    state = guide.start()
    for ch in "9007199254740991":
        assert tok.convert_tokens_to_ids(ch) in mask_of(guide, state, len(tok))
        state.advance(tok.convert_tokens_to_ids(ch))
    assert mask_of(guide, state, len(tok)) == {tok.eos_token_id}  # a 17th digit would leave the safe range
