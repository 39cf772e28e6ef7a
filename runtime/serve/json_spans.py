"""Where JSON values start and end in text a model may still be writing: what lets a streamed tool call send its
arguments' raw text as it grows (runtime/serve/tool_stream.py) and the finished parse return the same text
(runtime/serve/tool_calls.py). Structure only: the caller checks a closed value with ``json``."""
from __future__ import annotations

import json
import re
from typing import NamedTuple

OPEN = -1  # the text ends inside the value
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)
_STRING_BODY = re.compile(r'(?:[^"\\]|\\.)*', re.DOTALL)  # a string's characters, up to its closing quote
_BRACKET_OR_QUOTE = re.compile(r'["{}\[\]]')
_SCALAR_END = re.compile(r'[\s,:{}\[\]"]')


def skip_blanks(text: str, i: int) -> int:
    """The index of the first character at or after ``i`` that is not a blank (``len(text)`` if none is)."""
    while i < len(text) and text[i].isspace():
        i += 1
    return i


def value_end(text: str, i: int) -> int | None:
    """The index just past the JSON value starting at ``text[i]``, ``OPEN`` while the text ends inside it (a scalar
    at the very end may still grow), None where no value starts there."""
    if i >= len(text):
        return OPEN
    if text[i] == '"':
        m = _STRING.match(text, i)
        return m.end() if m else OPEN
    if text[i] in "{[":
        return GrowingValue(text, i).feed(text)
    m = _SCALAR_END.search(text, i)
    if m is None:
        return OPEN
    return m.start() if m.start() > i else None


class Members(NamedTuple):
    """An object's top-level members so far: each key's first value as ``(start, end)`` (end ``OPEN`` while the
    text ends inside it), and the index past the object's ``}`` (``OPEN`` while it is open)."""

    spans: dict[str, tuple[int, int]]
    end: int


def members(text: str, i: int) -> Members | None:
    """The members of the JSON object starting at ``text[i]`` as far as the text goes; None where no object starts
    there or its structure breaks (a closed object may still hold a bad scalar: ``json.loads`` it)."""
    if not text.startswith("{", i):
        return None
    spans: dict[str, tuple[int, int]] = {}
    j = skip_blanks(text, i + 1)
    if text.startswith("}", j):
        return Members(spans, j + 1)
    while True:
        if j >= len(text):
            return Members(spans, OPEN)
        key_end = value_end(text, j)
        if text[j] != '"' or key_end is None:
            return None
        if key_end == OPEN:
            return Members(spans, OPEN)
        try:
            key = json.loads(text[j:key_end])
        except json.JSONDecodeError:
            return None
        j = skip_blanks(text, key_end)
        if j < len(text) and text[j] != ":":
            return None
        j = skip_blanks(text, j + 1)
        if j >= len(text):
            return Members(spans, OPEN)
        end = value_end(text, j)
        if end is None:
            return None
        spans.setdefault(key, (j, end))
        if end == OPEN:
            return Members(spans, OPEN)
        j = skip_blanks(text, end)
        if j >= len(text):
            return Members(spans, OPEN)
        if text[j] == "}":
            return Members(spans, j + 1)
        if text[j] != ",":
            return None
        j = skip_blanks(text, j + 1)


class GrowingValue:
    """A JSON object or array the text is still writing, followed as the text grows: ``feed`` reads only what was
    appended since its last call (strings and brackets, as ``value_end`` reads them), so a stream need not read the
    value again from its start at each token."""

    def __init__(self, text: str, start: int):
        if not text.startswith(("{", "["), start):
            raise ValueError(f"no JSON object or array starts at {start}")
        self.start, self.at, self.depth, self.in_string = start, start, 0, False

    def feed(self, text: str) -> int:
        """The index past the value in ``text`` (the same text as before, grown), ``OPEN`` while it is open."""
        if self.depth == 0 and self.at > self.start:
            return self.at  # closed already
        j = self.at
        while True:
            if self.in_string:  # stop at the closing quote, or where the text ends (a lone "\\" waits for more)
                j = _STRING_BODY.match(text, j).end()
                if j == len(text) or text[j] != '"':
                    self.at = j
                    return OPEN
                self.in_string, j = False, j + 1
                continue
            m = _BRACKET_OR_QUOTE.search(text, j)
            if m is None:
                self.at = len(text)
                return OPEN
            j = m.end()
            c = m.group()
            if c == '"':
                self.in_string = True
                continue
            self.depth += 1 if c in "{[" else -1
            if self.depth == 0:
                self.at = j
                return j
