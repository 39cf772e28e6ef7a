"""Tool calling: the tool-call formats models are trained on, as data in one place; the parse of a finished output
into OpenAI ``tool_calls``; and the grammar that makes ``tool_choice`` "required" or a named function hold.

A format is how a model writes one call: ``begin`` + a JSON object naming the function and its arguments + ``end``
(Hermes/Qwen2.5/Qwen3: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``; Llama 3.x: a bare
``{"name": ..., "parameters": {...}}``). The server picks one with ``--tool-call-parser`` (vLLM's flag, same
names). The tools themselves reach the model through its own chat template (``tools=``), which says how to call
them; with "required" or a named function the output is constrained to calls of the offered functions, whose
arguments follow their JSON-schema ``parameters``, so even a 135M model returns a valid call.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from runtime.guided import GuideSpec


@dataclass(frozen=True)
class ToolFormat:
    begin: str  # text before each call's JSON ("" for bare JSON)
    end: str
    args_key: str  # the JSON key holding the arguments


FORMATS = {
    "hermes": ToolFormat("<tool_call>\n", "\n</tool_call>", "arguments"),  # Hermes 2/3, Qwen2.5, Qwen3, SmolLM3
    "llama3_json": ToolFormat("", "", "parameters"),  # Llama 3.1/3.2/3.3 JSON tool calling
}


def call_schema(tools: list[dict], fmt: ToolFormat, name: str | None = None) -> dict:
    """JSON schema of one call of ``name`` (or of any offered function)."""
    def one(fn: dict) -> dict:
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        return {"type": "object", "properties": {"name": {"const": fn["name"]}, fmt.args_key: params},
                "required": ["name", fmt.args_key], "additionalProperties": False}
    functions = [t["function"] for t in tools if name is None or t["function"]["name"] == name]
    return one(functions[0]) if len(functions) == 1 else {"anyOf": [one(f) for f in functions]}


def guide_spec(tools: list[dict], fmt: ToolFormat, name: str | None = None) -> GuideSpec:
    """Output constrained to one call of ``name`` (tool_choice naming a function) or of any tool ("required")."""
    source = {"begin": fmt.begin, "schema": call_schema(tools, fmt, name), "end": fmt.end}
    return GuideSpec("tagged_json", json.dumps(source, sort_keys=True))


def _call(obj, fmt: ToolFormat) -> dict | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(fmt.args_key, obj.get("arguments", obj.get("parameters", {})))
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": obj["name"], "arguments": args if isinstance(args, str) else json.dumps(args)}}


def parse(text: str, fmt: ToolFormat) -> tuple[str | None, list[dict]]:
    """``(content, tool_calls)`` of a finished output; text that is not a well-formed call stays content."""
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
