"""Structured output that holds on a real quantized model: 20 JSON schemas (nested objects, arrays, enums, bounded
integers and numbers, required fields, ``additionalProperties: false``) x 5 prompts, plus regexes and choices, decoded
by the engine under the grammar (xgrammar), every output parsed and validated with ``jsonschema`` (issue 35).

  .venv/bin/python scripts/bench/schemas.py --model out/smollm2-135m-awq4 [--max-tokens 256]

Sampling at temperature 0.7 (seeded), 16 requests in flight; prints one line per kind and each failure.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

S, I, N = {"type": "string", "maxLength": 24}, {"type": "integer"}, {"type": "number"}


def _obj(props: dict, required: list[str] | None = None) -> dict:
    return {"type": "object", "properties": props, "required": required if required is not None else list(props),
            "additionalProperties": False}


SCHEMAS = [
    _obj({"name": S, "age": {"type": "integer", "minimum": 0, "maximum": 120}}),
    _obj({"title": S, "year": {"type": "integer", "minimum": 1900, "maximum": 2030}, "rating": {**N, "minimum": 0, "maximum": 10}}),
    _obj({"city": S, "country": S, "population": {"type": "integer", "minimum": 0}}),
    _obj({"color": {"type": "string", "enum": ["red", "green", "blue"]}, "size": {"enum": ["S", "M", "L", "XL"]}}),
    _obj({"tags": {"type": "array", "items": S, "minItems": 1, "maxItems": 4}}),
    _obj({"scores": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 100}, "maxItems": 5}}),
    _obj({"user": _obj({"id": I, "email": S}), "active": {"type": "boolean"}}),
    _obj({"order": _obj({"id": I, "items": {"type": "array", "items": _obj({"sku": S, "qty": {"type": "integer", "minimum": 1}}), "maxItems": 3}})}),
    _obj({"name": S, "nickname": S}, required=["name"]),
    _obj({"lat": {**N, "minimum": -90, "maximum": 90}, "lon": {**N, "minimum": -180, "maximum": 180}}),
    _obj({"answer": {"type": "string", "enum": ["yes", "no", "maybe"]}, "confidence": {**N, "minimum": 0, "maximum": 1}}),
    _obj({"steps": {"type": "array", "items": _obj({"n": I, "text": S}), "minItems": 1, "maxItems": 3}}),
    _obj({"price": {**N, "minimum": 0}, "currency": {"enum": ["USD", "EUR", "GBP"]}, "in_stock": {"type": "boolean"}}),
    _obj({"a": _obj({"b": _obj({"c": I})})}),
    _obj({"matrix": {"type": "array", "items": {"type": "array", "items": I, "maxItems": 3}, "maxItems": 3}}),
    _obj({"event": S, "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}}),
    _obj({"ok": {"type": "boolean"}, "error": {"type": ["string", "null"], "maxLength": 24}}),
    _obj({"language": {"enum": ["python", "rust", "go"]}, "stars": {"type": "integer", "minimum": 0, "maximum": 100000}}),
    _obj({"first": S, "last": S, "address": _obj({"street": S, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}})}),
    _obj({"items": {"type": "array", "items": {"enum": ["apple", "pear", "plum"]}, "minItems": 2, "maxItems": 2}}),
]
PROMPTS = ["Answer with a JSON object.", "Describe something from your day as JSON.",
           "Fill in this record as JSON for a famous person.", "Return JSON for an online shop.",
           "Write one JSON object, nothing else."]
REGEXES = [r"[0-9]{3}-[0-9]{4}", r"(yes|no)\.", r"[A-Z][a-z]{2,8} [0-9]{1,2}"]
CHOICES = [["Paris", "London", "Rome"], ["positive", "negative", "neutral"]]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--max-tokens", type=int, default=256)
    args = ap.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    import jsonschema

    from runtime.config import EngineConfig
    from runtime.engine import Engine
    from runtime.guided import Guides, GuideSpec
    from runtime.sequence import SamplingParams

    engine = Engine(EngineConfig(model=args.model, max_model_len=1024, max_num_seqs=16))
    tok, guides = engine.tokenizer, Guides(engine.tokenizer, engine.runner.vocab_size, engine.eos_token_ids)

    def ids(text: str) -> list[int]:
        chat = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
        return tok(chat, add_special_tokens=False)["input_ids"]

    def run(kind: str, cases: list[tuple[str, GuideSpec, object]], check) -> None:
        t0 = time.perf_counter()
        params = [SamplingParams(max_tokens=args.max_tokens, temperature=0.7, seed=i, guide=guides.compile(spec))
                  for i, (_, spec, _) in enumerate(cases)]
        outs = engine.generate([ids(p) for p, _, _ in cases], params)
        bad = [(p, o.text) for (p, _, want), o in zip(cases, outs) if not check(o.text, want)]
        print(f"{kind}: {len(cases) - len(bad)} of {len(cases)} valid ({time.perf_counter() - t0:.0f} s)")
        for p, text in bad:
            print(f"  invalid for {p!r}: {text[:200]!r}")

    def valid_json(text: str, schema: dict) -> bool:
        try:
            jsonschema.validate(json.loads(text), schema)
            return True
        except (ValueError, jsonschema.ValidationError):
            return False

    run("json_schema", [(p, GuideSpec.json_schema(s), s) for s in SCHEMAS for p in PROMPTS], valid_json)
    run("regex", [(f"Write text matching {r}.", GuideSpec("regex", r), r) for r in REGEXES for _ in range(5)],
        lambda text, r: re.fullmatch(r, text) is not None)
    run("choice", [(f"Pick one of {', '.join(c)}.", GuideSpec.choice(c), c) for c in CHOICES for _ in range(5)],
        lambda text, c: text in c)


if __name__ == "__main__":
    main()
