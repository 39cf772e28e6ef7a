"""Streamed tool calls: outputs fed a token-sized piece (and a character) at a time, the deltas accumulated as
OpenAI's client does, equal the finished output's parse; each call's name goes out before its arguments close, the
arguments in pieces as they are written, and nothing sent is ever taken back."""
import json
import re

import pytest

from runtime.serve.tool_calls import FORMATS, parse, scan
from runtime.serve.tool_stream import ToolStream

# name-first calls with argument objects, as models write them: (a) to (d) all hold
STREAMED = [
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}\n'
               '</tool_call>\n<tool_call>\n{"name": "g", "arguments": {"a": "}\\n</tool_call>", "b": [1, {"c": null}]}}'
               '\n</tool_call>'),
    # compact, as guided decoding writes it
    ("hermes", '<tool_call>\n{"name":"f","arguments":{"x":1,"y":"\\u00e9 é","z":{}}}\n</tool_call>'),
    ("llama3_json", '{"name": "f", "parameters": {"x": 1, "q": "a;b"}}; {"name": "g", "parameters": {"z": [1, 2]}}'),
    ("llama3_json", '{"name": "f", "arguments": {"x": 1.5e3, "y": false}}'),
    ("mistral", 'Sure. [TOOL_CALLS] [{"name": "f", "arguments": {"x": [1, 2], "y": "]"}}, '
                '{"name": "g", "arguments": {"k": "v", "w": 2}}]'),
    ("mistral", '[TOOL_CALLS] {"name": "f", "arguments": {"a": 1, "b": 2}}'),  # a lone object
    ("mistral_v11", 'On it.[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo", "unit": "c"}[TOOL_CALLS]get_time[ARGS] '
                    '{"zone": 1, "dst": true}'),
]
# content, broken calls, arguments after the name or not an object: (c) and (d) hold
OTHERS = [
    ("hermes", "No tools needed: <tool the answer is 4.  "),
    ("hermes", 'Broken <tool_call>\n{"name": oops}\n</tool_call> then <tool_call>\n{"name": "h", "arguments": {}}'),
    ("hermes", 'Before <tool_call>\n{"name": "f", "arguments": {}}\n</tool_call> and after'),
    ("hermes", '<tool_call>\n{"arguments": {"x": 1, "y": 2}, "name": "f"}\n</tool_call>'),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": "{\\"x\\": 1}"}\n</tool_call>'),  # arguments as a string
    ("hermes", '<tool_call>\n{"name": "f"}\n</tool_call>'),  # no arguments: "{}"
    ("mistral", "[TOOL_CALLS] [1, 2]"),
    ("mistral", "Plain [TOOL words]"),
    ("llama3_json", "The answer is {4}."),
    ("llama3_json", '{"answer": 4}'),
    ("mistral_v11", "[TOOL_CALLS]f[ARGS]{} done"),
    ("mistral_v11", "[TOOL_CALLS]two words[ARGS]{}"),
]
# cut by max_tokens inside a call: the stream holds the parse's calls and the cut one as far as it went
CUT = [
    ("mistral", '[TOOL_CALLS] [{"name": "f", "arguments": {}}, {"name": "g", "argu'),
    ("mistral_v11", '[TOOL_CALLS]f[ARGS]{"a": 1}[TOOL_CALLS]g[ARGS]{"b'),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": 1, "b'),
]
MARKERS = re.compile(r"<tool_call>|</tool_call>|\[TOOL_CALLS\]|\[ARGS\]| ?\w+| ?[^\w\s]+|\s+")


def token_pieces(text: str) -> list[str]:
    """The output as a BPE tokenizer might cut it: markers whole, words and runs of punctuation with their blank."""
    pieces = MARKERS.findall(text)
    assert "".join(pieces) == text
    return pieces


def accumulate(deltas: list[dict], into: dict) -> None:
    """What OpenAI's client does with streamed deltas: content concatenated, tool calls merged by index."""
    for d in deltas:
        into["content"] += d.get("content") or ""
        for tc in d.get("tool_calls", ()):
            call = into["calls"].setdefault(tc["index"], {"id": None, "name": "", "arguments": "", "pieces": 0})
            assert ("id" in tc) == (call["id"] is None), "the id (and name) come once, in a call's first delta"
            assert tc["index"] == len(into["calls"]) - 1 or "id" not in tc, "calls are numbered in order"
            if "id" in tc:
                assert tc["type"] == "function" and tc["function"]["arguments"] == ""
                call.update(id=tc["id"], name=tc["function"]["name"])
            else:
                assert tc["function"]["arguments"], "no empty argument deltas"
                call["pieces"] += 1
            call["arguments"] += tc["function"]["arguments"]


def run(fmt_name: str, text: str, pieces: list[str], parallel: bool = True):
    """Streams ``text`` in ``pieces``; checks after every step that what was sent is a prefix of the final message
    (d), and returns the accumulated message, the parse, and how far the output was when each call was named."""
    fmt, stream = FORMATS[fmt_name], ToolStream(FORMATS[fmt_name], parallel)
    content, calls = parse(text, fmt)
    calls = calls if parallel else calls[:1]
    final = [(c["function"]["name"], c["function"]["arguments"]) for c in calls]
    got, named_at, end = {"content": "", "calls": {}}, {}, 0
    for piece in pieces:
        end += len(piece)
        accumulate(stream.step(text[:end]), got)
        for k, call in got["calls"].items():
            named_at.setdefault(k, end)
            if k < len(final):  # (d): nothing sent changes later
                assert call["name"] == final[k][0] and final[k][1].startswith(call["arguments"])
        assert (content or "").startswith(got["content"].lstrip())
    accumulate(stream.finish(content, calls), got)
    return got, content, final, named_at


def split(text: str, how: str) -> list[str]:
    return token_pieces(text) if how == "tokens" else list(text)


@pytest.mark.parametrize("fmt_name,text", STREAMED + OTHERS)
@pytest.mark.parametrize("how", ["tokens", "chars"])
def test_accumulated_stream_equals_the_parse(fmt_name, text, how):
    got, content, final, _ = run(fmt_name, text, split(text, how))
    assert got["content"] == (content or "")
    assert [(c["name"], c["arguments"]) for c in got["calls"].values()] == final


@pytest.mark.parametrize("fmt_name,text", STREAMED)
@pytest.mark.parametrize("how", ["tokens", "chars"])
def test_names_go_out_first_and_arguments_in_pieces(fmt_name, text, how):
    got, _, final, named_at = run(fmt_name, text, split(text, how))
    assert final and len(got["calls"]) == len(final)
    at = 0
    for k, (name, arguments) in enumerate(final):
        at = text.index(arguments, at) + len(arguments)  # where the call's arguments close
        assert named_at[k] < at  # (a)
        if len(json.loads(arguments)) > 1:
            assert got["calls"][k]["pieces"] > 1  # (b)


@pytest.mark.parametrize("fmt_name,text", CUT)
def test_a_call_cut_short_streams_as_far_as_it_went(fmt_name, text):
    got, _, final, _ = run(fmt_name, text, token_pieces(text))
    streamed = [(c["name"], c["arguments"]) for c in got["calls"].values()]
    assert streamed[:len(final)] == final and len(streamed) == len(final) + 1
    name, arguments = streamed[-1]
    assert name in text and text.endswith(arguments)


def test_arguments_are_the_models_raw_text():
    """Unstreamed too: what the model wrote (no re-serializing that would reorder, respace or escape it)."""
    for fmt_name, text in STREAMED:
        for call in parse(text, FORMATS[fmt_name])[1]:
            assert call["function"]["arguments"] in text
    assert parse('<tool_call>\n{"name": "f", "arguments": "{\\"x\\": 1}"}', FORMATS["hermes"])[1][0]["function"][
        "arguments"] == '{"x": 1}'


def test_content_streams_before_the_call_and_holds_a_possible_marker():
    stream = ToolStream(FORMATS["hermes"], True)
    assert stream.step("Let me") == [{"content": "Let me"}]
    assert stream.step("Let me check <tool") == [{"content": " check"}]  # " <tool" may start a call: held
    assert stream.step("Let me check <tool_call>\n{") == []
    text = "Let me check <tool_call>\n{"  # finished without a call: all of it is content
    assert stream.finish(text, []) == [{"content": " <tool_call>\n{"}]


def test_the_name_goes_out_once_whole_then_the_arguments_as_written():
    stream = ToolStream(FORMATS["hermes"], True)
    assert stream.step('<tool_call>\n{"name": "get_wea') == []
    (first,) = stream.step('<tool_call>\n{"name": "get_weather", ')
    assert first["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
    assert stream.step('<tool_call>\n{"name": "get_weather", "arguments": {"ci') == [
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"ci'}}]}]
    v11 = ToolStream(FORMATS["mistral_v11"], True)
    assert v11.step("[TOOL_CALLS]get_time[ARGS]") == []  # named, but sent with its arguments' "{"
    assert [d["tool_calls"][0]["function"] for d in v11.step('[TOOL_CALLS]get_time[ARGS]{"zo')] == [
        {"name": "get_time", "arguments": ""}, {"arguments": '{"zo'}]


def test_calls_so_far_hold_the_open_one():
    calls = scan('[TOOL_CALLS]f[ARGS]{"a": {"b": 1}}[TOOL_CALLS]g[ARGS]{"c": [', FORMATS["mistral_v11"]).calls
    assert [(c.name, c.arguments, c.end > 0) for c in calls] == [("f", '{"a": {"b": 1}}', True),
                                                                 ("g", '{"c": [', False)]


def test_one_call_without_parallel_calls():
    text = STREAMED[4][1]
    got, _, final, _ = run("mistral", text, token_pieces(text), parallel=False)
    assert len(final) == 1 and [(c["name"], c["arguments"]) for c in got["calls"].values()] == final


@pytest.mark.parametrize("fmt_name", ["hermes", "llama3_json", "mistral", "mistral_v11"])
def test_a_long_call_streams_without_reading_the_output_again(fmt_name, monkeypatch):
    """While a call's arguments grow, a step reads only the new text: an agent's file of ~6k tokens streams in
    linear time (the scan of the whole output at every token took ~7 s of the server's time on one)."""
    import runtime.serve.tool_stream as tool_stream
    rows = json.dumps({"rows": [{"id": i, "s": "}\\\"]" * (i % 3), "t": [i, None]} for i in range(300)]})
    text = {"hermes": '<tool_call>\n{"name": "w", "arguments": ' + rows + '}\n</tool_call>',
            "llama3_json": '{"name": "w", "parameters": ' + rows + '}',
            "mistral": '[TOOL_CALLS] [{"name": "w", "arguments": ' + rows + '}]',
            "mistral_v11": '[TOOL_CALLS]w[ARGS]' + rows}[fmt_name]
    scans = []
    monkeypatch.setattr(tool_stream, "scan", lambda *a: scans.append(1) or scan(*a))
    pieces = token_pieces(text)
    got, _, final, _ = run(fmt_name, text, pieces)
    assert [(c["name"], c["arguments"]) for c in got["calls"].values()] == final == [("w", rows)]
    assert len(pieces) > 3000 and len(scans) < 20
