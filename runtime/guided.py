"""Structured output: a request's JSON schema, JSON object, regex, choice or EBNF grammar compiled to a token
automaton that masks the logits of its sequence at every step.

The grammar engine is xgrammar (maintained, on PyPI with CPU wheels). Measured on this machine (AMD EPYC, a
shared 2-core VM, one thread, SmolLM2's 49,152-token vocabulary, a nested schema with enums, bounded integers and
``additionalProperties: false``, ~300 masks of random walks; ``scripts/bench/guided.py mask``, three runs):
xgrammar fills a mask in 30-48 us on average (p99 69-127 us, slowest 0.2 ms); llguidance 1.9.1 in 111-232 us
(p99 0.65-8.3 ms, slowest 1.3-25 ms: it builds lexer states lazily on the first tokens of a grammar). At 10-80 ms
per decode step on CPU both are small, but xgrammar's is steady and several times lower; both read the HF
tokenizer as it is. xgrammar's own CPU ``apply_token_bitmask_inplace`` takes ~600 us per 49k-wide row, so the
bits are unpacked with numpy here instead (~45 us a row, the fill included).

Flow: the server turns a request into a ``GuideSpec`` and compiles it (``Guides.compile``: a 400 for an invalid
schema, before any work; compiled grammars are cached by a hash of the spec and the tokenizer). The compiled
``Guide`` rides in ``SamplingParams.guide``; the sampler gives each guided sequence its own matcher state
(``Sequence.guide_state``) and masks its logit row; the engine advances the state with each accepted token; the
state goes with the sequence when it finishes or its client leaves. Under speculative decoding
(runtime/speculative.py) drafts are cut where the grammar stops accepting them, and verify row ``i`` is masked
with the state the first ``i`` drafts reach: the matcher walks forward over the drafts and is rolled back, so it
only ever advances by the tokens the engine accepts, and greedy output is the same with or without drafts.
``min_tokens`` does not apply to them: the
grammar decides when they may stop. JSON is generated compact (no free whitespace), so a small model cannot
spend its ``max_tokens`` on blank lines; a grammar that cannot finish in ``max_tokens`` ends with "length".
"""
from __future__ import annotations

import hashlib
import json
import logging
import sys
import threading
from collections import OrderedDict
from dataclasses import dataclass
import numpy as np
import torch
from torch import Tensor

log = logging.getLogger(__name__)
KINDS = ("json_schema", "json_object", "regex", "choice", "grammar", "tagged_json")  # tagged: begin + schema + end


@dataclass(frozen=True)
class GuideSpec:
    """What a request constrains its output to: ``kind`` (one of KINDS) and its source text."""

    kind: str
    source: str = ""

    def __post_init__(self):
        assert self.kind in KINDS, self.kind

    @classmethod
    def choice(cls, choices: list[str]) -> GuideSpec:
        if not choices or not all(isinstance(c, str) and c for c in choices):
            raise ValueError("choice must be a non-empty list of non-empty strings")
        return cls("choice", json.dumps(choices, ensure_ascii=False))

    @classmethod
    def json_schema(cls, schema: dict | str) -> GuideSpec:
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ValueError(f"the JSON schema is not valid JSON ({e})") from None
        if not isinstance(schema, dict):
            raise ValueError("the JSON schema must be a JSON object")
        return cls("json_schema", json.dumps(schema, sort_keys=True))


class GuideState:
    """One sequence's position in its grammar."""

    def __init__(self, matcher):
        self.matcher = matcher

    def advance(self, token_id: int) -> None:
        if not self.matcher.is_terminated() and not self.matcher.accept_token(token_id):
            log.warning("grammar rejected token %d; the rest of this output is unconstrained", token_id)
            self.matcher = None

    def try_token(self, token_id: int) -> bool:
        """Take ``token_id`` if the grammar allows it here (a draft, walked ahead and rolled back later)."""
        return self.matcher is not None and not self.matcher.is_terminated() and self.matcher.accept_token(token_id)

    def rollback(self, n: int) -> None:
        if n:
            self.matcher.rollback(n)


class Guide:
    """A compiled grammar; ``start()`` gives a new sequence its state, ``mask`` constrains logit rows."""

    def __init__(self, compiled, vocab_size: int):
        self.compiled, self.vocab_size = compiled, vocab_size

    def start(self) -> GuideState:
        import xgrammar as xgr

        return GuideState(xgr.GrammarMatcher(self.compiled))

    @staticmethod
    def mask(logits: Tensor, rows: list[int], states: list[GuideState]) -> None:
        """Set the logits each row's grammar forbids next to -inf (in place); ``logits: [n, V]``."""
        import xgrammar as xgr

        live = [(r, s.matcher) for r, s in zip(rows, states) if s.matcher is not None and not s.matcher.is_terminated()]
        if not live:
            return
        bitmask = xgr.allocate_token_bitmask(len(live), logits.shape[1])  # [rows, ceil(V / 32)] int32
        for i, (_, matcher) in enumerate(live):
            matcher.fill_next_token_bitmask(bitmask, i)
        _apply_bits(logits, [r for r, _ in live], bitmask)


def _apply_bits(logits: Tensor, index: list[int], bitmask: Tensor) -> None:
    """-inf where bitmask row ``k`` forbids a token of logits row ``index[k]``."""
    # bit j of word w allows token 32 w + j; little-endian bytes unpack in that order. The words are inverted first,
    # so the unpacked bytes are the forbidden tokens as a bool mask as they stand, and each row is filled in place
    # through a view: ~45 us a 49k-wide row, against ~140 us gathering the rows, comparing and scattering them back
    # (and ~600 us for xgrammar's own CPU apply)
    assert sys.byteorder == "little"
    words = np.invert(bitmask.numpy()[:len(index)])
    forbid = np.unpackbits(words.view(np.uint8), axis=-1, bitorder="little")[:, :logits.shape[1]]
    forbid = torch.from_numpy(np.ascontiguousarray(forbid)).view(torch.bool)
    for k, row in enumerate(index):
        logits[row].masked_fill_(forbid[k], float("-inf"))


def _state(seq) -> GuideState:
    if seq.guide_state is None:
        seq.guide_state = seq.params.guide.start()
    return seq.guide_state


def apply(logits: Tensor, seqs: list) -> None:
    """Mask the rows of guided sequences (starting their state on first use)."""
    rows = [i for i, s in enumerate(seqs) if s.params.guide is not None]
    if rows:
        Guide.mask(logits, rows, [_state(seqs[i]) for i in rows])


def accepted_drafts(seq, drafts: list[int]) -> int:
    """How many of ``drafts`` the grammar of ``seq`` takes in order (all for an unguided or unconstrained sequence);
    its state is left as it was."""
    if seq.params.guide is None or _state(seq).matcher is None:
        return len(drafts)
    n = 0
    while n < len(drafts) and seq.guide_state.try_token(drafts[n]):
        n += 1
    seq.guide_state.rollback(n)
    return n


class DraftWalk:
    """Guided sequences' states walked ahead over the tokens a draft model proposes, so each next proposal is masked
    with the state the earlier ones reach (drafts the grammar takes); ``undo`` rolls every state back."""

    def __init__(self):
        self.taken: dict = {}  # sequence -> tokens its matcher took
        self.stopped: set = set()  # sequences whose matcher refused a proposal (or finished): the rest go unmasked

    def mask(self, logits: Tensor, seqs: list) -> None:
        """Mask the guided rows (a draft model with another vocabulary size goes unmasked)."""
        rows = [i for i, s in enumerate(seqs) if s.params.guide is not None and s not in self.stopped
                and s.params.guide.vocab_size == logits.shape[1]]
        if rows:
            Guide.mask(logits, rows, [_state(seqs[i]) for i in rows])

    def take(self, seq, token_id: int) -> None:
        if seq.params.guide is None or seq in self.stopped:
            return
        if _state(seq).try_token(token_id):
            self.taken[seq] = self.taken.get(seq, 0) + 1
        else:
            self.stopped.add(seq)

    def undo(self) -> None:
        for seq, n in self.taken.items():
            seq.guide_state.rollback(n)
        self.taken.clear()
        self.stopped.clear()


def apply_to_drafts(logits: Tensor, seq, drafts: list[int]) -> None:
    """Mask one sequence's verify rows, ``logits: [1 + len(drafts), V]``: row ``i`` with the state after
    ``drafts[:i]`` (drafts the grammar takes: see accepted_drafts; rows past a finished grammar stay free, as in
    ``Guide.mask``). The matcher walks forward over the drafts and is rolled back."""
    import xgrammar as xgr

    matcher = _state(seq).matcher
    if matcher is None:
        return
    bitmask = xgr.allocate_token_bitmask(len(drafts) + 1, logits.shape[1])
    rows, n = 0, 0
    while rows <= len(drafts) and not matcher.is_terminated():
        matcher.fill_next_token_bitmask(bitmask, rows)
        rows += 1
        if rows > len(drafts) or not matcher.accept_token(drafts[rows - 1]):
            break
        n += 1
    matcher.rollback(n)
    _apply_bits(logits, list(range(rows)), bitmask)


def _tokenizer_hash(tokenizer, vocab_size: int, stop_ids) -> str:
    h = hashlib.sha256(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    h.update(repr((vocab_size, sorted(stop_ids), type(tokenizer).__name__)).encode())
    return h.hexdigest()


class Guides:
    """Compiles GuideSpecs for one tokenizer, keeping the most recent ``capacity`` compiled grammars."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids=(), capacity: int = 128):
        import xgrammar as xgr

        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=list(stop_token_ids) or None)
        self.compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
        self.vocab_size, self.capacity = vocab_size, capacity
        self.tokenizer_hash = _tokenizer_hash(tokenizer, vocab_size, stop_token_ids)
        self._cache: OrderedDict[str, Guide] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.compiles = 0

    def key(self, spec: GuideSpec) -> str:
        return hashlib.sha256(f"{self.tokenizer_hash}\0{spec.kind}\0{spec.source}".encode()).hexdigest()

    def compile(self, spec: GuideSpec) -> Guide:
        """The compiled grammar for ``spec``; ValueError naming the problem when it does not compile."""
        key = self.key(spec)
        with self._lock:
            if key in self._cache:
                self.hits += 1
                self._cache.move_to_end(key)
                return self._cache[key]
        try:
            guide = Guide(self._compile(spec), self.vocab_size)
        except (RuntimeError, ValueError, TypeError) as e:  # xgrammar raises RuntimeError for a bad schema/regex
            raise ValueError(f"the {spec.kind.replace('_', ' ')} does not compile: {str(e).splitlines()[0]}") from None
        with self._lock:
            self.compiles += 1
            self._cache[key] = guide
            while len(self._cache) > self.capacity:
                self._cache.popitem(last=False)
        return guide

    def _compile(self, spec: GuideSpec):
        c = self.compiler
        if spec.kind == "json_schema":
            return c.compile_json_schema(json.dumps(bounded(json.loads(spec.source))), any_whitespace=False,
                                         strict_mode=True)
        if spec.kind == "json_object":  # OpenAI's json_object is an object, not any JSON value
            return c.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
        if spec.kind == "regex":
            return c.compile_regex(spec.source)
        if spec.kind == "choice":
            options = json.loads(spec.source)
            return c.compile_grammar("root ::= " + " | ".join(json.dumps(o, ensure_ascii=False) for o in options))
        if spec.kind == "tagged_json":
            return c.compile_grammar(_tagged_json(json.loads(spec.source)))
        return c.compile_grammar(spec.source)


def _tagged_json(source: dict):
    """``begin`` + a compact JSON value of ``schema`` + ``end`` (the shape of a tool call), or any one of the
    ``source["any"]`` such forms (one per function, where the name sits in ``begin``)."""
    import xgrammar as xgr

    if "any" in source:
        forms = [_tagged_json(one) for one in source["any"]]
        return xgr.Grammar.union(*forms) if len(forms) > 1 else forms[0]

    parts = [xgr.Grammar.from_json_schema(json.dumps(bounded(source["schema"])), any_whitespace=False)]
    if source["begin"]:
        parts.insert(0, xgr.Grammar.from_ebnf(f"root ::= {json.dumps(source['begin'])}"))
    if source["end"]:
        parts.append(xgr.Grammar.from_ebnf(f"root ::= {json.dumps(source['end'])}"))
    return xgr.Grammar.concat(*parts) if len(parts) > 1 else parts[0]


SAFE_INTEGER = 2**53 - 1  # the integers every JSON reader holds exactly (RFC 8259's interoperable range)


def bounded(schema):
    """``schema`` with every integer and number that has no bound given +-2**53 - 1: the grammar then caps its
    digits, so a small model cannot write one digit after another until ``max_tokens`` (unbounded, SmolLM2 awq4 did
    on 2 of 100 schema-prompt pairs) and every output parses. Explicit bounds are kept."""
    if isinstance(schema, list):
        return [bounded(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: bounded(v) for k, v in schema.items()}
    types = schema.get("type")
    if {"integer", "number"} & set(types if isinstance(types, list) else [types]):
        if "minimum" not in out and "exclusiveMinimum" not in out:
            out["minimum"] = -SAFE_INTEGER
        if "maximum" not in out and "exclusiveMaximum" not in out:
            out["maximum"] = SAFE_INTEGER
    return out
