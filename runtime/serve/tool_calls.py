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
"""
from __future__ import annotations

import json
import random
import re
import string
import uuid
from dataclasses import dataclass

from runtime.guided import GuideSpec


@dataclass(frozen=True)
class ToolFormat:
    """How a model writes tool calls (the text its chat template puts in an assistant turn with ``tool_calls``)."""

    begin: str  # text before each call's JSON ("" for bare JSON), or before the array of all calls
    end: str
    args_key: str  # the JSON key holding the arguments
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


def _call(obj, fmt: ToolFormat) -> dict | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(fmt.args_key, obj.get("arguments", obj.get("parameters", {})))
    return {"id": fmt.new_id(), "type": "function",
            "function": {"name": obj["name"], "arguments": args if isinstance(args, str) else json.dumps(args)}}


def _array_items(text: str, i: int) -> tuple[list, int]:
    """The JSON values of the array starting at ``text[i]`` that a "," or "]" has closed (a lone object: itself),
    and the index just past the array (-1 while it is open or broken)."""
    dec, items = json.JSONDecoder(), []
    if text.startswith("{", i):
        try:
            value, end = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            return [], -1
        return [value], end
    if not text.startswith("[", i):
        return [], -1
    i += 1
    while True:
        while i < len(text) and text[i].isspace():
            i += 1
        try:
            value, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            return items, -1
        while i < len(text) and text[i].isspace():
            i += 1
        if i >= len(text) or text[i] not in ",]":
            return items, -1
        items.append(value)
        if text[i] == "]":
            return items, i + 1
        i += 1


def _parse_array(text: str, fmt: ToolFormat) -> tuple[str | None, list[dict]]:
    """The calls of the JSON array after the first ``begin`` marker (those a "," or "]" closed, so an array cut
    short keeps its whole calls); the text before the marker and after the array is content."""
    marker = fmt.begin.strip()
    at = text.find(marker)
    if at < 0:
        return text, []
    start = at + len(marker)
    start += len(text[start:]) - len(text[start:].lstrip())
    items, end = _array_items(text, start)
    calls = [_call(obj, fmt) for obj in items]
    if not calls or not all(calls):
        return text, []
    content = (text[:at] + (text[end:] if end >= 0 else "")).strip()
    return content or None, calls


def _parse_named(text: str, fmt: ToolFormat) -> tuple[str | None, list[dict]]:
    """``begin name args_marker {...}`` calls from the first ``begin``: each whole call, up to the first that is
    not (a call cut short is dropped, other text after the calls is content)."""
    marker, dec = fmt.begin.strip(), json.JSONDecoder()
    at = text.find(marker)
    if at < 0:
        return text, []
    calls, i = [], at
    while text.startswith(marker, i):
        sep = text.find(fmt.args_marker, i + len(marker))
        name = text[i + len(marker):sep].strip() if sep >= 0 else ""
        j = sep + len(fmt.args_marker)
        j += len(text[j:]) - len(text[j:].lstrip())
        try:
            args, j = dec.raw_decode(text, j)
        except json.JSONDecodeError:
            break
        if not name or any(c.isspace() for c in name) or not isinstance(args, dict):
            break
        calls.append(_call({"name": name, fmt.args_key: args}, fmt))
        i = j + len(text[j:]) - len(text[j:].lstrip())
    if not calls:
        return text, []
    rest = "" if text.startswith(marker, i) else text[i:]
    return (text[:at] + rest).strip() or None, calls


def closed_calls(text: str, fmt: ToolFormat) -> list[dict]:
    """The calls an unfinished output has closed so far, each as ``parse`` of the finished output will find it: in
    an array, the calls a "," or "]" followed; tagged calls up to the last end tag; bare JSON only when finished."""
    if fmt.array:
        return _parse_array(text, fmt)[1]
    if fmt.args_marker:  # a call is whole once its arguments' JSON closes
        return _parse_named(text, fmt)[1]
    end = fmt.end.strip()
    cut = text.rfind(end) if end else -1
    return parse(text[:cut + len(end)], fmt)[1] if cut >= 0 else []


def parse(text: str, fmt: ToolFormat) -> tuple[str | None, list[dict]]:
    """``(content, tool_calls)`` of a finished output; text that is not a well-formed call stays content."""
    if fmt.array:
        return _parse_array(text, fmt)
    if fmt.args_marker:
        return _parse_named(text, fmt)
    if not fmt.begin:  # bare JSON: the whole output is one call, or several joined by ";"
        try:
            calls = [_call(json.loads(part), fmt) for part in text.split(";") if part.strip()]
        except json.JSONDecodeError:
            return text, []
        return (None, calls) if calls and all(calls) else (text, [])
    pattern = re.compile(re.escape(fmt.begin.strip()) + r"\s*(\{.*?\})\s*(?:" + re.escape(fmt.end.strip()) + r"|$)",
                         re.DOTALL)
    calls, kept, last = [], [], 0
    for m in pattern.finditer(text):
        try:
            call = _call(json.loads(m.group(1)), fmt)
        except json.JSONDecodeError:
            call = None
        if call is not None:
            calls.append(call)
            kept.append(text[last:m.start()])
            last = m.end()
    content = ("".join(kept) + text[last:]).strip() if calls else text
    return content or None, calls
