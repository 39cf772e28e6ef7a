"""The JSON span scanner behind streamed tool calls: every prefix of a JSON document is open (never broken), the
whole one closes where ``json`` says it does, and an object's members are the values ``json`` reads; a growing value
fed a character at a time answers what ``value_end`` does for every prefix."""
import json

import pytest

from runtime.serve.json_spans import OPEN, GrowingValue, members, value_end

DOCS = ['{"a": "}\\"{", "b": [1, {"c": null}], "d": -1.5e3, "e": true, "a": 2}', '["x", [], {}]', '"a\\\\"',
        '{"name":"f","arguments":{"x":1}}', '{ }', '{"\\u0061b": "é"}']


@pytest.mark.parametrize("doc", DOCS)
def test_prefixes_are_open_and_the_whole_closes(doc):
    assert value_end(doc + " tail", 0) == len(doc) == json.JSONDecoder().raw_decode(doc + " tail")[1]
    for n in range(1, len(doc)):
        assert value_end(doc[:n], 0) == OPEN
        if doc.startswith("{"):
            assert members(doc[:n], 0) is not None and members(doc[:n], 0).end == OPEN


@pytest.mark.parametrize("doc", [d for d in DOCS if d.startswith("{")])
def test_members_are_the_first_value_of_each_key(doc):
    m = members(doc, 0)
    assert m.end == len(doc)
    first = json.loads(doc, object_pairs_hook=lambda pairs: dict(reversed(pairs)))  # a repeated key: its first value
    assert {k: json.loads(doc[s:e]) for k, (s, e) in m.spans.items()} == first


def test_what_is_not_json_breaks():
    assert value_end("}", 0) is None and value_end(" 1", 0) is None
    assert members("[1]", 0) is None and members("{a: 1}", 0) is None and members('{"a" 1}', 0) is None
    assert members('{"a": 1 "b": 2}', 0) is None


GROWING = [d for d in DOCS if d.startswith(("{", "["))] + ['{"k": "a\\\\\\"b"}', '[1, "[", {"x": "\\\\"}]']


@pytest.mark.parametrize("doc", GROWING)
def test_a_growing_value_reads_each_character_once_and_agrees(doc):
    text = "x: " + doc + " tail"
    for cut in range(4, len(text) + 1):
        grown = GrowingValue(text, 3)
        seen = [grown.feed(text[:n]) for n in range(4, cut + 1)]
        closed = [e for e in seen if e != OPEN]
        assert (closed[0] if closed else OPEN) == value_end(text[:cut], 3)
        assert all(e == closed[0] for e in closed)  # once closed it stays so
        assert grown.at <= 3 + len(doc)  # and reads no further
    with pytest.raises(ValueError, match="no JSON object or array"):
        GrowingValue('"a"', 0)
