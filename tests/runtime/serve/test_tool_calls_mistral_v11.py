"""Mistral's tool calls from tokenizer v11 on (``[TOOL_CALLS]name[ARGS]{...}`` per call: Mistral Small 3.2,
Magistral, Devstral): chosen by ``--tool-call-parser mistral`` where the tokenizer holds ``[ARGS]``; the parser, the
grammar of one call of an offered function, a round trip through a v11-style template, and tool_choice through the
real `openai` client against a tiny random Mistral, streamed and not."""
import json
import re

import pytest

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

from live_server import char_tokenizer  # noqa: E402
from runtime.serve.tool_calls import FORMATS, format_for, guide_spec, parse, scan  # noqa: E402
from test_tool_calls import TIME, WEATHER, calls_of, check_call, streamed_and_whole  # noqa: E402
from test_tool_calls_mistral import MISTRAL_SPECIALS, names_args, serve_tiny_mistral  # noqa: E402

V11 = FORMATS["mistral_v11"]
# the v11 templates' assistant turn, cut to what matters here: each call as [TOOL_CALLS] + name + [ARGS] + arguments
V11_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m.role == 'user' %}{% if tools and loop.last %}"
    "[AVAILABLE_TOOLS]{{ tools | map(attribute='function.name') | join(' ') }}[/AVAILABLE_TOOLS]"
    "{% endif %}[INST]{{ m.content }}[/INST]"
    "{% elif m.role == 'assistant' and m.tool_calls %}{% for c in m.tool_calls %}"
    "{% set a = c.function.arguments %}[TOOL_CALLS]{{ c.function.name }}[ARGS]"
    "{{ a if a is string else a | tojson }}{% endfor %}{{ eos_token }}"
    "{% elif m.role == 'assistant' %}{{ m.content }}{{ eos_token }}"
    "{% elif m.role == 'tool' %}[TOOL_RESULTS]{{ m.content }}[/TOOL_RESULTS]{% endif %}{% endfor %}")


def v11_tokenizer():
    tok = char_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": MISTRAL_SPECIALS + ["[ARGS]"]})
    tok.chat_template = V11_TEMPLATE
    return tok


def test_the_mistral_parser_takes_the_v11_form_where_the_tokenizer_has_args():
    older = char_tokenizer()
    older.add_special_tokens({"additional_special_tokens": MISTRAL_SPECIALS})
    assert format_for("mistral", older) is FORMATS["mistral"]
    assert format_for("mistral", v11_tokenizer()) is V11
    assert format_for("hermes", v11_tokenizer()) is FORMATS["hermes"]


def test_v11_parse():
    text = 'On it.[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo", "unit": "c"}[TOOL_CALLS]get_time[ARGS] {"zone": 1}'
    content, calls = parse(text, V11)
    assert content == "On it." and names_args(calls) == [("get_weather", {"city": "Oslo", "unit": "c"}),
                                                         ("get_time", {"zone": 1})]
    assert all(re.fullmatch(r"[A-Za-z0-9]{9}", c["id"]) for c in calls)
    # a call cut short (max_tokens) is dropped, the whole ones kept; text after the calls is content
    assert names_args(parse('[TOOL_CALLS]f[ARGS]{"a": 1}[TOOL_CALLS]g[ARGS]{"b', V11)[1]) == [("f", {"a": 1})]
    assert parse('[TOOL_CALLS]f[ARGS]{} done', V11)[0] == "done"
    for kept in ("plain words", "[TOOL_CALLS]f[ARGS]{broken", "[TOOL_CALLS]two words[ARGS]{}", "[TOOL_CALLS]f[ARGS][1]",
                 '[TOOL_CALLS]f{"a": 1}'):
        assert parse(kept, V11) == (kept, [])
    # streamed: a call is named once its arguments' "{" begins, and whole once they close
    def so_far(text):
        return [(c.name, c.arguments) for c in scan(text, V11).calls]
    assert so_far('[TOOL_CALLS]f[ARGS]{"a": {"b": 1') == [("f", '{"a": {"b": 1')]
    assert so_far('[TOOL_CALLS]f[ARGS]{"a": {"b": 1}}[TOOL_CALLS]g') == [("f", '{"a": {"b": 1}}'), (None, "")]


def test_v11_guide_is_one_call_of_an_offered_function():
    from runtime.guided import Guides

    named = json.loads(guide_spec([WEATHER, TIME], V11, "get_time").source)["any"]
    assert [(a["begin"], a["end"]) for a in named] == [("[TOOL_CALLS]get_time[ARGS]", "")]
    assert named[0]["schema"] == TIME["function"]["parameters"]
    spec = guide_spec([WEATHER, TIME], V11, None, parallel=True)
    assert len(json.loads(spec.source)["any"]) == 2
    tok = v11_tokenizer()
    guide = Guides(tok, len(tok)).compile(spec)
    state = guide.start()  # try_token advances where the grammar allows the token
    assert all(state.try_token(t) for t in tok('[TOOL_CALLS]get_time[ARGS]{"zone": -3}', add_special_tokens=False)
               ["input_ids"])
    assert state.try_token(tok.eos_token_id) and state.matcher.is_terminated()
    bad = guide.start()
    assert not all(bad.try_token(t) for t in tok("[TOOL_CALLS]get_date", add_special_tokens=False)["input_ids"])


def test_v11_round_trip_through_the_template():
    tok = v11_tokenizer()
    calls = [{"id": "abcDEF123", "type": "function", "function": {"name": "get_weather",
                                                                   "arguments": {"city": "Oslo", "unit": "c"}}},
             {"id": "xyz987XYZ", "type": "function", "function": {"name": "get_time", "arguments": {"zone": 1}}}]
    history = [{"role": "user", "content": "w?"}, {"role": "assistant", "content": None, "tool_calls": calls}]
    turn = tok.apply_chat_template(history, tools=[WEATHER, TIME], tokenize=False).split("[/INST]", 1)[1]
    content, parsed = parse(turn.removesuffix(tok.eos_token), V11)
    assert content is None and names_args(parsed) == [(c["function"]["name"], c["function"]["arguments"])
                                                      for c in calls]


@pytest.fixture(scope="module")
def v11_served(tmp_path_factory):
    s = serve_tiny_mistral(tmp_path_factory.mktemp("tiny-mistral-v11"), v11_tokenizer())
    yield s
    s.close()


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_v11_calls_through_the_client(v11_served, choice):
    """A constrained call comes back parsed (both special markers kept in the text to find it), with an id the
    template takes back, streamed as the client accumulates the unstreamed answer."""
    kw = dict(model="tiny", messages=[{"role": "user", "content": "weather?"}], tools=[WEATHER, TIME],
              tool_choice=choice, seed=1, max_tokens=200, temperature=1.0)
    streamed, whole, _ = streamed_and_whole(v11_served.client(), **kw)
    assert whole.finish_reason == "tool_calls" and whole.message.content is None, whole.message
    assert len(whole.message.tool_calls) == 1 and calls_of(streamed) == calls_of(whole)
    call = whole.message.tool_calls[0]
    check_call(call, [WEATHER, TIME])
    assert re.fullmatch(r"[A-Za-z0-9]{9}", call.id)
    if isinstance(choice, dict):
        assert call.function.name == "get_time"
    history = kw["messages"] + [whole.message.model_dump(exclude_none=True),
                                {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    r = v11_served.client().chat.completions.create(**{**kw, "messages": history, "tool_choice": "auto",
                                                       "max_tokens": 4})
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
