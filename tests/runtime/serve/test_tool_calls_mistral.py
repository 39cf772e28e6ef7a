"""Mistral's tool calls (``[TOOL_CALLS]`` + one JSON array of calls): the parser, the grammar's array, a round trip
through a Mistral-style template that refuses ids other than 9 letters/digits, and tool_choice through the real
`openai` client against a tiny random Mistral whose tokenizer holds ``[TOOL_CALLS]`` as a special token."""
import json
import re

import pytest

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

from live_server import Served, char_tokenizer  # noqa: E402
from runtime.config import EngineConfig  # noqa: E402
from runtime.engine import Engine  # noqa: E402
from runtime.serve.tool_calls import FORMATS, ToolFormat, guide_spec, parse  # noqa: E402
from test_tool_calls import TIME, WEATHER, calls_of, check_call, streamed_and_whole  # noqa: E402

MISTRAL = FORMATS["mistral"]
MISTRAL_SPECIALS = ["[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]",
                    "[/TOOL_RESULTS]"]
# Mistral 7B Instruct v0.3's template, cut to what matters here: the tools before the last user turn (by name only:
# the character tokenizer spends a token per character), the calls as "[TOOL_CALLS] [" + JSON objects + "]" + EOS,
# and its refusal of ids that are not 9 characters
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m.role == 'user' %}{% if tools and loop.last %}"
    "[AVAILABLE_TOOLS] {{ tools | map(attribute='function.name') | join(' ') }}[/AVAILABLE_TOOLS]"
    "{% endif %}[INST] {{ m.content }}[/INST]"
    "{% elif m.role == 'assistant' and m.tool_calls %}[TOOL_CALLS] [{% for c in m.tool_calls %}"
    "{% if c.id is not string or c.id | length != 9 %}"
    "{{ raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{% endif %}"
    "{{ {'name': c.function.name, 'arguments': c.function.arguments, 'id': c.id} | tojson }}"
    "{% if not loop.last %}, {% endif %}{% endfor %}]{{ eos_token }}"
    "{% elif m.role == 'assistant' %} {{ m.content }}{{ eos_token }}"
    "{% elif m.role == 'tool' %}[TOOL_RESULTS] {{ {'content': m.content, 'call_id': m.tool_call_id} | tojson }}"
    "[/TOOL_RESULTS]{% endif %}{% endfor %}")


def mistral_tokenizer():
    tok = char_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": MISTRAL_SPECIALS})
    tok.chat_template = MISTRAL_TEMPLATE
    return tok


def names_args(calls) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def test_mistral_parse():
    text = 'Checking. [TOOL_CALLS] [{"name": "f", "arguments": {"a": [1, 2]}}, {"name": "g", "arguments": {}}]'
    content, calls = parse(text, MISTRAL)
    assert content == "Checking." and names_args(calls) == [("f", {"a": [1, 2]}), ("g", {})]
    assert all(re.fullmatch(r"[A-Za-z0-9]{9}", c["id"]) and c["type"] == "function" for c in calls)
    assert names_args(parse('[TOOL_CALLS]{"name": "f", "arguments": {}}', MISTRAL)[1]) == [("f", {})]  # one object
    for kept in ("[TOOL_CALLS] [{not json}]", "[TOOL_CALLS] [1, 2]", "plain words", '[{"name": "f", "arguments": {}}]'):
        assert parse(kept, MISTRAL) == (kept, [])
    with pytest.raises(ValueError, match="begin marker"):
        ToolFormat("", "", "arguments", array=True)


def test_mistral_guide_is_an_array_after_the_marker():
    one = json.loads(guide_spec([WEATHER, TIME], MISTRAL, "get_time", parallel=True).source)
    assert one["begin"] == "[TOOL_CALLS] " and one["end"] == ""
    assert one["schema"]["type"] == "array" and one["schema"]["maxItems"] == 1
    assert one["schema"]["items"]["properties"]["name"] == {"const": "get_time"}
    many = json.loads(guide_spec([WEATHER, TIME], MISTRAL, None, parallel=True).source)["schema"]
    assert "maxItems" not in many and many["minItems"] == 1 and len(many["items"]["anyOf"]) == 2
    hermes = json.loads(guide_spec([WEATHER], FORMATS["hermes"], None, parallel=True).source)["schema"]
    assert hermes["type"] == "object"  # one tagged call, as before


def test_round_trip_through_the_template():
    """Calls rendered by the template parse back to the same calls, and the parsed ids render again."""
    tok = mistral_tokenizer()
    calls = [{"id": "abcDEF123", "type": "function", "function": {"name": "get_weather",
                                                                   "arguments": {"city": "Oslo", "unit": "c"}}},
             {"id": "xyz987XYZ", "type": "function", "function": {"name": "get_time", "arguments": {"zone": 1}}}]
    history = [{"role": "user", "content": "w?"}, {"role": "assistant", "content": None, "tool_calls": calls}]
    text = tok.apply_chat_template(history, tools=[WEATHER, TIME], tokenize=False)
    turn = text.split("[/INST]", 1)[1].removesuffix(tok.eos_token)
    content, parsed = parse(turn, MISTRAL)
    assert content is None and names_args(parsed) == [(c["function"]["name"], c["function"]["arguments"])
                                                      for c in calls]
    back = [{**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}} for c in parsed]
    tok.apply_chat_template(history[:1] + [{"role": "assistant", "content": None, "tool_calls": back}],
                            tokenize=False)
    with pytest.raises(Exception, match="length 9"):  # why the format's ids are 9 characters
        tok.apply_chat_template(history[:1] + [{"role": "assistant", "content": None, "tool_calls": [
            {**back[0], "id": "call_0123456789abcdef"}]}], tokenize=False)


def serve_tiny_mistral(path, tok) -> Served:
    """A tiny random Mistral with ``tok`` saved at ``path``, served with ``--tool-call-parser mistral``."""
    import torch
    from tiny_models import tiny_config
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)  # the same random model whichever tests ran before (they move the global generator)
    cfg = tiny_config("mistral", vocab=len(tok))
    cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id = tok.bos_token_id, tok.eos_token_id, tok.pad_token_id
    AutoModelForCausalLM.from_config(cfg).eval().save_pretrained(path)
    tok.save_pretrained(path)
    engine = Engine(EngineConfig(model=str(path), max_model_len=256, kv_cache_memory=8 << 20, block_size=16))
    return Served(engine, model_name="tiny", api_key="test-key", tool_call_parser="mistral")


@pytest.fixture(scope="module")
def mistral_served(tmp_path_factory):
    s = serve_tiny_mistral(tmp_path_factory.mktemp("tiny-mistral"), mistral_tokenizer())
    yield s
    s.close()


@pytest.mark.parametrize("choice,parallel", [("required", False), ("required", True),
                                             ({"type": "function", "function": {"name": "get_time"}}, True)])
def test_mistral_calls_through_the_client(mistral_served, choice, parallel):
    """Constrained calls come back parsed (the special ``[TOOL_CALLS]`` kept in the text to find them), with ids the
    template accepts when the client sends them back."""
    c = mistral_served.client()
    ask = [{"role": "user", "content": "weather?"}]
    r = c.chat.completions.create(model="tiny", messages=ask, tools=[WEATHER, TIME], tool_choice=choice, seed=1,
                                  max_tokens=200, temperature=1.0, parallel_tool_calls=parallel)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content is None, ch.message
    assert len(ch.message.tool_calls) == 1 or parallel
    for call in ch.message.tool_calls:
        check_call(call, [WEATHER, TIME])
        assert re.fullmatch(r"[A-Za-z0-9]{9}", call.id)
    if isinstance(choice, dict):
        assert [t.function.name for t in ch.message.tool_calls] == ["get_time"]
    history = ask + [ch.message.model_dump(exclude_none=True)] + [
        {"role": "tool", "tool_call_id": t.id, "content": "sunny"} for t in ch.message.tool_calls]
    r = c.chat.completions.create(model="tiny", messages=history, tools=[WEATHER, TIME], max_tokens=4)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_mistral_streamed_calls_equal_the_unstreamed(mistral_served):
    kw = dict(model="tiny", messages=[{"role": "user", "content": "w"}], tools=[WEATHER, TIME], tool_choice="required",
              max_tokens=200, seed=3, temperature=1.0)
    streamed, whole, _ = streamed_and_whole(mistral_served.client(), **kw)
    assert calls_of(streamed) == calls_of(whole) and calls_of(whole)
    assert streamed.finish_reason == whole.finish_reason == "tool_calls" and not streamed.message.content
