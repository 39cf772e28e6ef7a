"""Streamed tool calls: outputs fed a few characters at a time, the deltas accumulated as OpenAI's client does, equal
the finished output's parse; each call goes out as soon as its JSON is closed, in OpenAI's two-delta shape."""
import pytest

from runtime.serve.tool_calls import FORMATS, parse
from runtime.serve.tool_stream import ToolStream

OUTPUTS = [
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "f", "arguments": {"a": "}"}}\n</tool_call>\n'
               '<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>'),
    ("hermes", "No tools needed: <tool the answer is 4.  "),
    ("hermes", 'Broken <tool_call>\n{"name": oops}\n</tool_call> then <tool_call>\n{"name": "h", "arguments": {}}'),
    ("hermes", 'Before <tool_call>\n{"name": "f", "arguments": {}}\n</tool_call> and after'),
    ("mistral", 'Sure. [TOOL_CALLS] [{"name": "f", "arguments": {"x": [1, 2]}}, {"name": "g", "arguments": {}}]'),
    ("mistral", '[TOOL_CALLS] [{"name": "f", "arguments": {}}, {"name": "g", "argu'),  # cut by max_tokens
    ("mistral", "[TOOL_CALLS] [1, 2]"),
    ("mistral", "Plain [TOOL words]"),
    ("llama3_json", '{"name": "f", "parameters": {"x": 1}}; {"name": "g", "parameters": {}}'),
    ("llama3_json", "The answer is {4}."),
]


def accumulate(deltas: list[dict], into: dict) -> None:
    """What OpenAI's client does with streamed deltas: content concatenated, tool calls merged by index."""
    for d in deltas:
        into["content"] += d.get("content") or ""
        for tc in d.get("tool_calls", ()):
            call = into["calls"].setdefault(tc["index"], {"id": None, "name": "", "arguments": ""})
            assert ("id" in tc) == (call["id"] is None), "the id (and name) come once, in a call's first delta"
            if "id" in tc:
                assert tc["type"] == "function" and tc["function"]["arguments"] == ""
                call.update(id=tc["id"], name=tc["function"]["name"])
            call["arguments"] += tc["function"]["arguments"]


def run(fmt_name: str, text: str, piece: int = 3, parallel: bool = True):
    fmt, stream = FORMATS[fmt_name], ToolStream(FORMATS[fmt_name], parallel)
    got, first_seen = {"content": "", "calls": {}}, {}
    for end in range(piece, len(text) + piece, piece):
        accumulate(stream.step(text[:end]), got)
        for k in got["calls"]:
            first_seen.setdefault(k, min(end, len(text)))
    content, calls = parse(text, fmt)
    calls = calls if parallel else calls[:1]
    accumulate(stream.finish(content, calls), got)
    return got, content, calls, first_seen


@pytest.mark.parametrize("fmt_name,text", OUTPUTS)
@pytest.mark.parametrize("piece", [1, 4])
def test_accumulated_stream_equals_the_parse(fmt_name, text, piece):
    got, content, calls, _ = run(fmt_name, text, piece)
    assert got["content"] == (content or "")
    assert [(c["name"], c["arguments"]) for c in got["calls"].values()] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in calls]


def test_calls_go_out_as_soon_as_they_close():
    text = OUTPUTS[0][1]
    _, _, _, first_seen = run("hermes", text, piece=1)
    assert first_seen[0] == text.index("</tool_call>") + len("</tool_call>") < len(text)
    text = OUTPUTS[4][1]
    _, _, _, first_seen = run("mistral", text, piece=1)
    assert first_seen[0] == text.index("}}, ") + 3 and first_seen[1] == len(text)


def test_content_streams_before_the_call_and_holds_a_possible_marker():
    stream = ToolStream(FORMATS["hermes"], True)
    assert stream.step("Let me") == [{"content": "Let me"}]
    assert stream.step("Let me check <tool") == [{"content": " check"}]  # " <tool" may start a call: held
    assert stream.step("Let me check <tool_call>\n{") == []
    text = "Let me check <tool_call>\n{"  # finished without a call: all of it is content
    assert stream.finish(text, []) == [{"content": " <tool_call>\n{"}]


def test_one_call_without_parallel_calls():
    got, _, calls, _ = run("mistral", OUTPUTS[4][1], parallel=False)
    assert len(calls) == 1 and [c["name"] for c in got["calls"].values()] == ["f"]
