"""Tool calling: the tool-call formats models are trained on, as data in one place; the parse of a finished output
into OpenAI ``tool_calls``; and the grammar that makes ``tool_choice`` "required" or a named function hold.

A format is how a model writes its calls: ``begin`` + a JSON object naming the function and its arguments + ``end``
for each call (Hermes/Qwen2.5/Qwen3: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``; Llama 3.x:
a bare ``{"name": ..., "parameters": {...}}``), or ``begin`` once and then all the calls as one JSON array (Mistral:
``[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]``), or ``begin`` + the bare name + ``args_marker`` + the
arguments' JSON for each call (Mistral tokenizers v11 and later: ``[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}``).
The server picks one with ``--tool-call-parser`` (vLLM's flag, same names; ``mistral`` takes the v11 form where
the tokenizer holds ``[ARGS]`` as a special token, as vLLM's parser does by tokenizer version). The tools themselves reach the model through its own chat template (``tools=``), which
says how to call them; with "required" or a named function the output is constrained to calls of the offered
functions, whose arguments follow their JSON-schema ``parameters``, so even a 135M model returns a valid call. A
marker the tokenizer holds as a special token (Mistral's ``[TOOL_CALLS]``) is kept in the text of tool requests.

A call's ``arguments`` are the model's raw JSON text, as OpenAI returns them, not a re-serialization: that is what a
stream can send while the model writes it (runtime/serve/tool_stream.py), so streamed and unstreamed agree exactly.
One scan (``scan``) reads an output for both: the calls so far, a last one still open included, each only growing.
"""
from __future__ import annotations

import json
import random
import string
import uuid
from dataclasses import dataclass
from typing import NamedTuple

from runtime.guided import GuideSpec
from runtime.serve.json_spans import OPEN, members, skip_blanks, value_end


@dataclass(frozen=True)
class ToolFormat:
    """How a model writes tool calls (the text its chat template puts in an assistant turn with ``tool_calls``)."""

    begin: str  # text before each call's JSON ("" for bare JSON), or before the array of all calls
    end: str
    args_key: str  # the JSON key the grammar puts the arguments under (the parse reads either of ARGS_KEYS)
    array: bool = False  # all calls in one JSON array after ``begin``, rather than ``begin`` + object + ``end`` each
    id_chars: int = 0  # call ids of this many letters and digits (the model's template refuses others); 0: call_<hex>
    args_marker: str = ""  # set: each call is begin + name + args_marker + the arguments' JSON (no JSON name key)

    def __post_init__(self):
        if (self.array or self.args_marker) and not self.begin.strip():
            raise ValueError("an array or named tool-call format needs a begin marker to find the calls by")
        if self.array and self.args_marker:
            raise ValueError("a tool-call format is an array of JSON calls or named calls, not both")
        if self.id_chars < 0:
            raise ValueError(f"id_chars={self.id_chars} must be >= 0")

    def new_id(self) -> str:
        if self.id_chars:
            return "".join(random.choices(string.ascii_letters + string.digits, k=self.id_chars))
        return f"call_{uuid.uuid4().hex[:24]}"


FORMATS = {
    "hermes": ToolFormat("<tool_call>\n", "\n</tool_call>", "arguments"),  # Hermes 2/3, Qwen2.5, Qwen3, SmolLM3
    "llama3_json": ToolFormat("", "", "parameters"),  # Llama 3.1/3.2/3.3 JSON tool calling
    # Mistral 7B v0.3, Mixtral 8x22B, Nemo, Small (tokenizers before v11): ids are 9 letters/digits or the template
    # raises
    "mistral": ToolFormat("[TOOL_CALLS] ", "", "arguments", array=True, id_chars=9),
    # Mistral tokenizers v11 and later (Small 3.2, Magistral, Devstral): [TOOL_CALLS]name[ARGS]{...} per call
    "mistral_v11": ToolFormat("[TOOL_CALLS]", "", "arguments", id_chars=9, args_marker="[ARGS]"),
}
# a parser name -> the format to use instead where the tokenizer holds that special token
BY_TOKENIZER = {"mistral": ("[ARGS]", "mistral_v11")}


def format_for(parser: str, tokenizer) -> ToolFormat:
    """The format of ``--tool-call-parser parser`` for this tokenizer (Mistral's by its special tokens)."""
    special, other = BY_TOKENIZER.get(parser, (None, parser))
    return FORMATS[other if special in getattr(tokenizer, "all_special_tokens", ()) else parser]


def _parameters(fn: dict) -> dict:
    """A function's arguments schema (an object with no properties where it declares none)."""
    return fn.get("parameters") or {"type": "object", "properties": {}}


def call_schema(tools: list[dict], fmt: ToolFormat, name: str | None = None) -> dict:
    """JSON schema of one call of ``name`` (or of any offered function)."""
    def one(fn: dict) -> dict:
        params = _parameters(fn)
        return {"type": "object", "properties": {"name": {"const": fn["name"]}, fmt.args_key: params},
                "required": ["name", fmt.args_key], "additionalProperties": False}
    functions = [t["function"] for t in tools if name is None or t["function"]["name"] == name]
    return one(functions[0]) if len(functions) == 1 else {"anyOf": [one(f) for f in functions]}


def guide_spec(tools: list[dict], fmt: ToolFormat, name: str | None = None, parallel: bool = False) -> GuideSpec:
    """Output constrained to one call of ``name`` (tool_choice naming a function) or of any tool ("required"); an
    array format with ``parallel`` (and no ``name``) may hold several calls."""
    if fmt.args_marker:  # the name sits outside the JSON: one call, its begin naming a function (any offered one)
        alternatives = [{"begin": f"{fmt.begin}{fn['name']}{fmt.args_marker}", "end": fmt.end,
                         "schema": _parameters(fn)}
                        for fn in (t["function"] for t in tools) if name is None or fn["name"] == name]
        return GuideSpec("tagged_json", json.dumps({"any": alternatives}, sort_keys=True))
    schema = call_schema(tools, fmt, name)
    if fmt.array:
        most = {} if parallel and name is None else {"maxItems": 1}
        schema = {"type": "array", "items": schema, "minItems": 1, **most}
    source = {"begin": fmt.begin, "schema": schema, "end": fmt.end}
    return GuideSpec("tagged_json", json.dumps(source, sort_keys=True))


ARGS_KEYS = ("arguments", "parameters")  # where models put a call's arguments (both, whichever comes first)


@dataclass(frozen=True)
class CallText:
    """One call as far as the output has written it: what a stream may send already and never takes back."""

    name: str | None  # once its text is whole (and, for a named call, its arguments' "{" has begun)
    arguments: str  # the model's raw arguments text so far; only grows, and is the final string once ``end`` is set
    end: int  # the index past the call's text, OPEN while the model is still writing it


class Scan(NamedTuple):
    """An output's calls (a last one still open included) and, were the output finished, its content."""

    calls: list[CallText]
    content: str


def _loads(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def _object_call(text: str, i: int) -> CallText | None:
    """The call whose JSON object starts at ``text[i]``, as far as written; None where it is not (or cannot become)
    one. Its arguments are the raw text of the first "arguments" or "parameters" member (a JSON string: the string
    it holds; none: "{}"), so the text streamed while the model writes a call is the text of the finished call."""
    m = members(text, i)
    if m is None:
        return None
    name = None
    if "name" in m.spans and m.spans["name"][1] != OPEN:
        name = _loads(text[slice(*m.spans["name"])])
        if not isinstance(name, str):
            return None
    key = min((k for k in ARGS_KEYS if k in m.spans), key=lambda k: m.spans[k][0], default=None)
    if m.end == OPEN:
        start, end = m.spans[key] if key else (0, 0)
        growing = key is not None and text[start] in "{["  # a string or scalar is sent once the call is whole
        return CallText(name, text[start:len(text) if end == OPEN else end] if growing else "", OPEN)
    if name is None or not isinstance(_loads(text[i:m.end]), dict):
        return None
    args = text[slice(*m.spans[key])] if key else "{}"
    value = _loads(args)
    return CallText(name, value if isinstance(value, str) else args, m.end)


def _tagged(text: str, fmt: ToolFormat) -> Scan:
    """``begin {call} end`` calls anywhere in the text: each a whole JSON call after a marker, its end tag (where
    written) taken with it; a marker not followed by one stays content."""
    marker, end_tag = fmt.begin.strip(), fmt.end.strip()
    calls, kept, last, i = [], [], 0, 0
    while (at := text.find(marker, i)) >= 0:
        i = at + len(marker)
        j = skip_blanks(text, i)
        call = CallText(None, "", OPEN) if j == len(text) else _object_call(text, j)
        if call is None:
            continue
        calls.append(call)
        if call.end == OPEN:
            break
        k = skip_blanks(text, call.end)
        i = k + len(end_tag) if end_tag and text.startswith(end_tag, k) else call.end
        kept.append(text[last:at])
        last = i
    return Scan(calls, "".join(kept) + text[last:])


def _bare(text: str, fmt: ToolFormat) -> Scan:
    """The whole output as JSON calls joined by ";" (a cut last one dropped); anything else is content."""
    calls, i = [], skip_blanks(text, 0)
    while i < len(text):
        call = _object_call(text, i)
        if call is None:
            return Scan([], text)
        calls.append(call)
        if call.end == OPEN:
            break
        i = skip_blanks(text, call.end)
        if i < len(text) and text[i] != ";":
            return Scan([], text)
        i = skip_blanks(text, i + 1)
    return Scan(calls, "" if calls else text)


def _array(text: str, fmt: ToolFormat) -> Scan:
    """The calls of the JSON array (or lone object) after the first ``begin``, up to the first item that is not a
    call or the array's end; the text before the marker and after a closed array is content."""
    marker = fmt.begin.strip()
    at = text.find(marker)
    if at < 0:
        return Scan([], text)
    i = skip_blanks(text, at + len(marker))
    lone = text.startswith("{", i)
    if not lone and not text.startswith("[", i):
        return Scan([], text)
    calls, j, end = [], i if lone else skip_blanks(text, i + 1), OPEN
    while j < len(text) and (call := _object_call(text, j)) is not None:
        calls.append(call)
        if call.end == OPEN:
            break
        j = skip_blanks(text, call.end)
        if lone or text.startswith("]", j):
            end = call.end if lone else j + 1
            break
        if not text.startswith(",", j):
            break
        j = skip_blanks(text, j + 1)
    if not calls:
        return Scan([], text)
    return Scan(calls, text[:at] + (text[end:] if end != OPEN else ""))


def _named(text: str, fmt: ToolFormat) -> Scan:
    """``begin name args_marker {...}`` calls from the first ``begin``: up to the first that is not one (a call cut
    short is dropped, other text after the calls is content). The name goes out once its arguments' "{" begins."""
    marker = fmt.begin.strip()
    at = text.find(marker)
    if at < 0:
        return Scan([], text)
    calls, i = [], at
    while text.startswith(marker, i):
        sep = text.find(fmt.args_marker, i + len(marker))
        name = text[i + len(marker):sep].strip() if sep >= 0 else ""
        j = skip_blanks(text, sep + len(fmt.args_marker))
        if sep < 0 or j == len(text):
            calls.append(CallText(None, "", OPEN))
            break
        end = value_end(text, j)
        if not name or any(c.isspace() for c in name) or not text.startswith("{", j) or end is None:
            break
        if end == OPEN:
            calls.append(CallText(name, text[j:], OPEN))
            break
        if not isinstance(_loads(text[j:end]), dict):
            break
        calls.append(CallText(name, text[j:end], end))
        i = skip_blanks(text, end)
    if not any(c.end != OPEN for c in calls):
        return Scan(calls, text)
    return Scan(calls, text[:at] + ("" if text.startswith(marker, i) else text[i:]))


def scan(text: str, fmt: ToolFormat) -> Scan:
    """The calls the output holds so far, each as far as written, and its content were it finished."""
    if fmt.array:
        return _array(text, fmt)
    if fmt.args_marker:
        return _named(text, fmt)
    return _tagged(text, fmt) if fmt.begin else _bare(text, fmt)


def parse(text: str, fmt: ToolFormat) -> tuple[str | None, list[dict]]:
    """``(content, tool_calls)`` of a finished output; text that is not a well-formed call stays content, a call cut
    short (max_tokens) is dropped. Arguments are the model's raw JSON text, as OpenAI returns them and as they
    stream (runtime/serve/tool_stream.py)."""
    found = scan(text, fmt)
    calls = [{"id": fmt.new_id(), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
             for c in found.calls if c.end != OPEN]
    if not calls:
        return text, []
    return found.content.strip() or None, calls
