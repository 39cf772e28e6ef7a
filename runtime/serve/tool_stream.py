"""Streamed tool calls as OpenAI streams them: the text before the first call as ``content`` deltas while it is
generated, then each call as a first delta ``{index, id, type, function: {name, arguments: ""}}`` as soon as its
name is whole, and deltas ``{index, function: {arguments}}`` with each piece of its arguments as the model writes
them; the finished output's parse sends the rest.

The arguments streamed are the model's raw JSON text (runtime/serve/tool_calls.py returns the same text unstreamed,
as OpenAI does, rather than re-serializing it), so their concatenation is the unstreamed ``arguments`` exactly.
Inside an arguments object or array every character written belongs to it, so nothing is held back there; an
argument value that is a JSON string (or missing) goes out whole once the call's JSON closes.

What a client accumulates equals the unstreamed message: the same calls (names, arguments; ids are new per
request) and the same content, except that content before a call keeps a leading blank the unstreamed answer
strips. Text that could still become a call marker, and blanks that could precede one, wait for the next output.
What is sent is never taken back, so a call whose JSON breaks after its name went out (only unguided, from a model
that writes malformed calls, or one cut by max_tokens) stays in the stream as far as it went, while the unstreamed
parse leaves it out.

While a call's arguments object grows, each step reads only the text appended since the last (a ``GrowingValue``),
not the whole output again: a long call (a file an agent writes, tens of thousands of characters) streams in time
linear in its length rather than quadratic (a 26k-character call: 7 s of the server's time -> a few ms).
"""
from __future__ import annotations

from runtime.serve.json_spans import OPEN, GrowingValue
from runtime.serve.tool_calls import ToolFormat, scan


class ToolStream:
    """One choice's streamed deltas: ``step`` with the output so far, ``finish`` with the finished message."""

    def __init__(self, fmt: ToolFormat, parallel: bool):
        self.fmt, self.limit = fmt, None if parallel else 1
        self.marker = fmt.begin.strip()
        self.content = ""  # content streamed so far
        self.calls_from: int | None = None  # where the first call starts in the output, once seen
        self.sent: list[str] = []  # each call's arguments streamed so far, by index (a call is in it once named)
        self.growing: GrowingValue | None = None  # the last call's arguments while they grow, once streamed

    def _calls_start(self, text: str) -> int | None:
        if self.marker:
            at = text.find(self.marker)
            return None if at < 0 else at
        body = text.lstrip()  # bare JSON: a call is the whole output, so it starts with "{"
        return len(text) - len(body) if body.startswith("{") else None

    def _content_end(self, text: str) -> int:
        """How much of ``text`` (no call started in it) is surely content: not a trailing blank or marker prefix."""
        end = len(text.rstrip())
        for k in range(min(len(self.marker) - 1, end), 0, -1):
            if text.endswith(self.marker[:k], 0, end):
                return len(text[:end - k].rstrip())
        return end

    def step(self, text: str) -> list[dict]:
        """The deltas an unfinished output ``text`` adds to what was streamed."""
        if self.calls_from is None:
            self.calls_from = self._calls_start(text)
            if self.calls_from is None and not self.marker and text.strip():
                self.calls_from = -1  # bare JSON that does not start with "{": no call can follow
        if self.calls_from is None or self.calls_from < 0:
            end = len(text) if self.calls_from == -1 else self._content_end(text)
            return self._text(text[:end])
        if self.growing is not None:
            if self.growing.feed(text) == OPEN:  # still inside the last call's arguments: all of the new text is theirs
                return self._calls([(None, "")] * (len(self.sent) - 1) + [(None, text[self.growing.start:])])
            self.growing = None
        deltas = self._text(text[:self.calls_from].rstrip())
        calls = scan(text[self.calls_from:], self.fmt).calls
        deltas += self._calls([(c.name, c.arguments) for c in calls])
        last = calls[-1] if calls else None
        if (last is not None and last.end == OPEN and last.arguments and len(calls) == len(self.sent)
                and self.sent[-1] == last.arguments):  # streamed as far as written: follow them from here if
            self.growing = _open_end(text, len(text) - len(last.arguments))  # they are the text's open end
        return deltas

    def finish(self, content: str | None, calls: list[dict]) -> list[dict]:
        """The deltas left once the finished output parsed to ``content`` and ``calls``."""
        content = content or ""
        rest = next((content[len(p):] for p in (self.content, self.content.lstrip()) if content.startswith(p)), "")
        deltas = [{"content": rest}] if rest else []
        return deltas + self._calls([(c["function"]["name"], c["function"]["arguments"]) for c in calls])

    def _text(self, content: str) -> list[dict]:
        if not content.startswith(self.content) or len(content) == len(self.content):
            return []
        new, self.content = content[len(self.content):], content
        return [{"content": new}]

    def _calls(self, calls: list[tuple[str | None, str]]) -> list[dict]:
        """A first delta for each call newly named, and the arguments each has grown by since the last deltas."""
        deltas = []
        for k, (name, arguments) in enumerate(calls[:self.limit]):
            if k == len(self.sent):
                if name is None:
                    break
                self.sent.append("")
                deltas.append({"tool_calls": [{"index": k, "id": self.fmt.new_id(), "type": "function",
                                               "function": {"name": name, "arguments": ""}}]})
            sent = self.sent[k]
            if len(arguments) > len(sent) and arguments.startswith(sent):
                self.sent[k] = arguments
                deltas.append({"tool_calls": [{"index": k, "function": {"arguments": arguments[len(sent):]}}]})
        return deltas


def _open_end(text: str, start: int) -> GrowingValue | None:
    """The object or array at ``text[start:]`` followed from here, if it is still open there (not, say, a call's
    closed arguments whose text the output happens to end with)."""
    if not text.startswith(("{", "["), start):
        return None
    value = GrowingValue(text, start)
    return value if value.feed(text) == OPEN else None
