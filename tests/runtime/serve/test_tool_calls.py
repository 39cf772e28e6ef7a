"""Tool calling: the format parsers, a round trip through a Hermes-style template, and tool_choice through the real
`openai` client against the app: "required" and named functions always give a valid call, even from a random model."""
import json

import openai
import pytest

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

from runtime.config import EngineConfig  # noqa: E402
from runtime.engine import Engine  # noqa: E402
from runtime.serve.tool_calls import FORMATS, parse  # noqa: E402
from test_server import KEY, Served, model_dir  # noqa: E402,F401 (fixtures)

HERMES_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools: {% for t in tools %}{{ t.function.name }} {% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>\n"
    "{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}\n</tool_call>{% endfor %}"
    "{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 6}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 12}},
    "required": ["zone"], "additionalProperties": False}}}


def test_hermes_parse():
    text = ('Let me check.<tool_call>\n{"name": "f", "arguments": {"a": {"b": 1}}}\n</tool_call>'
            '<tool_call>\n{"name": "g", "arguments": {}}')  # the last one cut by EOS before its end tag
    content, calls = parse(text, FORMATS["hermes"])
    assert content == "Let me check."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [("f", {"a": {"b": 1}}),
                                                                                              ("g", {})]
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
    assert parse("<tool_call>\n{not json}\n</tool_call>", FORMATS["hermes"]) == ("<tool_call>\n{not json}\n</tool_call>", [])
    assert parse("plain words", FORMATS["hermes"]) == ("plain words", [])


def test_llama3_json_parse():
    fmt = FORMATS["llama3_json"]
    content, calls = parse('{"name": "f", "parameters": {"x": 1}}; {"name": "g", "parameters": {}}', fmt)
    assert content is None and [c["function"]["name"] for c in calls] == ["f", "g"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"x": 1}
    assert parse("The answer is 4.", fmt) == ("The answer is 4.", [])


def test_the_parse_reads_json_not_patterns():
    """Markers and separators inside JSON strings are text; arguments are the model's raw text; a whole call is a
    call even where the model forgets the end tag."""
    hermes, llama = FORMATS["hermes"], FORMATS["llama3_json"]
    content, calls = parse('<tool_call>\n{"name": "f", "arguments": {"s": "}\\n</tool_call>", "t": "é"}}\n</tool_call>',
                           hermes)
    assert content is None and calls[0]["function"]["arguments"] == '{"s": "}\\n</tool_call>", "t": "é"}'
    assert parse('{"name": "f", "parameters": {"q": "a;b"}}', llama)[1][0]["function"]["arguments"] == '{"q": "a;b"}'
    content, calls = parse('<tool_call>{"name": "f", "arguments": {"x":1}} then', hermes)
    assert content == "then" and calls[0]["function"]["arguments"] == '{"x":1}'
    assert parse('{"name": "f", "arguments": {"x": 1}}', llama)[1][0]["function"]["arguments"] == '{"x": 1}'


def test_round_trip_through_the_template(model_dir):  # noqa: F811
    """An assistant turn with calls, rendered by the template, parses back to the same calls."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    calls = [{"id": "1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}},
             {"id": "2", "type": "function", "function": {"name": "get_time", "arguments": {"zone": 1}}}]
    text = tok.apply_chat_template([{"role": "assistant", "content": "", "tool_calls": calls}], tools=[WEATHER, TIME],
                                   chat_template=HERMES_TEMPLATE, tokenize=False)
    turn = text.split("<|im_start|>assistant\n", 1)[1].removesuffix("<|im_end|>\n")
    _, parsed = parse(turn, FORMATS["hermes"])
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in calls]


@pytest.fixture(scope="module")
def served(model_dir):  # noqa: F811
    engine = Engine(EngineConfig(model=str(model_dir), max_model_len=256, kv_cache_memory=8 << 20, block_size=16))
    engine.tokenizer.chat_template = HERMES_TEMPLATE
    s = Served(engine, model_name="tiny", api_key=KEY)
    yield s
    s.close()


def check_call(call, tools):
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in tools}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), schema)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_required_and_named_choices_give_valid_calls(served, choice):
    c = served.client()
    for seed in range(3):
        r = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "weather?"}],
                                      tools=[WEATHER, TIME], tool_choice=choice, max_tokens=120, temperature=1.0,
                                      seed=seed)
        ch = r.choices[0]
        assert ch.finish_reason == "tool_calls" and len(ch.message.tool_calls) == 1, ch.message
        check_call(ch.message.tool_calls[0], [WEATHER, TIME])
        if isinstance(choice, dict):
            assert ch.message.tool_calls[0].function.name == "get_time"


def test_history_with_calls_auto_none_and_errors(served):
    c = served.client()
    history = [{"role": "user", "content": "w"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": 2}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "14:00"}]
    r = c.chat.completions.create(model="tiny", messages=history, tools=[TIME], max_tokens=8, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    r = c.chat.completions.create(model="tiny", messages=history, tools=[TIME], tool_choice="none", max_tokens=8)
    assert r.choices[0].message.tool_calls is None
    with pytest.raises(openai.BadRequestError, match="get_date"):
        c.chat.completions.create(model="tiny", messages=history, tools=[TIME], max_tokens=8,
                                  tool_choice={"type": "function", "function": {"name": "get_date"}})
    with pytest.raises(openai.BadRequestError, match="tool_choice needs tools"):
        c.chat.completions.create(model="tiny", messages=history, tool_choice="required", max_tokens=8)
    with pytest.raises(openai.BadRequestError, match="response_format"):
        c.chat.completions.create(model="tiny", messages=history, tools=[TIME], tool_choice="required", max_tokens=8,
                                  response_format={"type": "json_object"})


def streamed_and_whole(client, **kw):
    """The message the `openai` client accumulates from the stream, and the unstreamed one, of the same request."""
    with client.chat.completions.stream(**kw) as stream:
        chunks = list(stream)
        streamed = stream.current_completion_snapshot.choices[0]  # get_final_completion refuses "length"
    return streamed, client.chat.completions.create(**kw).choices[0], chunks


def calls_of(choice) -> list[tuple[str, str]]:
    return [(t.function.name, t.function.arguments) for t in choice.message.tool_calls or ()]


@pytest.mark.parametrize("choice", ["required", "auto", {"type": "function", "function": {"name": "get_weather"}}])
def test_streamed_calls_accumulate_to_the_unstreamed_ones(served, choice):
    """OpenAI's stream shape: a call's first delta has its id, type, name and empty arguments, the next ones its
    arguments; what the client accumulates equals the unstreamed answer."""
    kw = dict(model="tiny", messages=[{"role": "user", "content": "w"}], tools=[WEATHER, TIME], tool_choice=choice,
              max_tokens=120, seed=5, temperature=1.0 if choice != "auto" else 0)
    streamed, whole, chunks = streamed_and_whole(served.client(), **kw)
    assert calls_of(streamed) == calls_of(whole) and streamed.finish_reason == whole.finish_reason
    assert (streamed.message.content or None) == whole.message.content
    deltas = [e.chunk.choices[0].delta for e in chunks if e.type == "chunk" and e.chunk.choices]
    firsts = [t for d in deltas for t in d.tool_calls or () if t.id is not None]
    assert len(firsts) == len(calls_of(whole)) == (0 if choice == "auto" else 1)
    assert all(t.type == "function" and t.function.name and t.function.arguments == "" for t in firsts)


def test_content_streams_before_a_call(served):
    """Free text before a call (tool_choice auto; a regex stands in for a model that talks first) arrives as
    content deltas ahead of the call's deltas, and the marker never shows in the content."""
    forced = r'I will check\.<tool_call>\n\{"name": "get_time", "arguments": \{"zone": 3\}\}\n</tool_call>'
    kw = dict(model="tiny", messages=[{"role": "user", "content": "w"}], tools=[TIME], max_tokens=150, temperature=0,
              extra_body={"guided_regex": forced})
    streamed, whole, chunks = streamed_and_whole(served.client(), **kw)
    assert whole.message.content == streamed.message.content == "I will check."
    assert calls_of(whole) == calls_of(streamed) == [("get_time", '{"zone": 3}')]
    kinds = [("content" if d.content else "call") for e in chunks if e.type == "chunk" and e.chunk.choices
             for d in [e.chunk.choices[0].delta] if d.content or d.tool_calls]
    assert kinds[0] == "content" and kinds[-1] == "call" and kinds.index("call") > 1  # text came in pieces first
    assert streamed.finish_reason == "tool_calls"


def test_arguments_stream_as_the_model_writes_them(served):
    """The real client sees the call's name first, then its arguments in several pieces, which add up to the
    unstreamed arguments: the model's own text (a regex stands in for a model that writes it)."""
    forced = (r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "Oslo", "unit": "c"\}\}\n</tool_call>')
    kw = dict(model="tiny", messages=[{"role": "user", "content": "w"}], tools=[WEATHER], max_tokens=150,
              temperature=0, extra_body={"guided_regex": forced})
    streamed, whole, chunks = streamed_and_whole(served.client(), **kw)
    assert calls_of(whole) == calls_of(streamed) == [("get_weather", '{"city": "Oslo", "unit": "c"}')]
    deltas = [e.chunk.choices[0].delta for e in chunks if e.type == "chunk" and e.chunk.choices]
    pieces = [t for d in deltas for t in d.tool_calls or ()]
    assert pieces[0].id and pieces[0].function.name == "get_weather" and pieces[0].function.arguments == ""
    assert all(t.id is None and t.index == 0 for t in pieces[1:]) and len(pieces) > 2
    assert "".join(t.function.arguments for t in pieces) == '{"city": "Oslo", "unit": "c"}'
    assert streamed.finish_reason == whole.finish_reason == "tool_calls"
