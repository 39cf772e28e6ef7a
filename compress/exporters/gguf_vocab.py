"""The tokenizer as GGUF metadata (``tokenizer.ggml.*``), read from a Hugging Face fast tokenizer.

Two of llama.cpp's vocabularies: ``gpt2`` (byte-level BPE: tokens and merges, SmolLM2, Qwen, Llama 3) and
``llama`` (SentencePiece: tokens with scores and ``<0xNN>`` byte tokens, Llama 2, Mistral, Gemma). Token
types follow llama.cpp's enum: special added tokens are CONTROL, other added tokens USER_DEFINED, and ids
the tokenizer does not fill (an embedding padded past the vocabulary) become ``[PAD{id}]`` UNUSED.
"""
from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
_BYTE_TOKEN = re.compile(r"^<0x[0-9A-Fa-f]{2}>$")

# llama.cpp's pre-tokenizer (tokenizer.ggml.pre) for a byte-level BPE, recognised from the Hugging Face
# pre-tokenizer: (name, a pre-tokenizer type that must be present, a regex fragment that must be present).
# First match wins; the split regexes of Llama 3 and Qwen2 differ only in how many digits make a piece.
PRE_TOKENIZERS = (
    ("llama-bpe", "Split", r"\p{N}{1,3}"),
    ("qwen2", "Split", r"\p{L}+|\p{N}|"),
    ("smollm", "Digits", ""),
    ("gpt-2", "ByteLevel", ""),
)


@dataclass
class Vocab:
    """Everything ``tokenizer.ggml.*`` holds; ``values()`` gives the metadata key -> value."""

    model: str
    pre: str | None
    tokens: list[str]
    types: list[int]
    scores: list[float] | None = None
    merges: list[str] | None = None
    special: dict[str, int] = field(default_factory=dict)  # bos / eos / unknown / padding -> id
    flags: dict[str, bool] = field(default_factory=dict)  # add_bos_token, add_eos_token, add_space_prefix
    chat_template: str | None = None

    def values(self) -> dict[str, object]:
        out: dict[str, object] = {"tokenizer.ggml.model": self.model}
        if self.pre is not None:
            out["tokenizer.ggml.pre"] = self.pre
        out["tokenizer.ggml.tokens"] = self.tokens
        out["tokenizer.ggml.token_type"] = self.types
        if self.scores is not None:
            out["tokenizer.ggml.scores"] = self.scores
        if self.merges is not None:
            out["tokenizer.ggml.merges"] = self.merges
        out.update({f"tokenizer.ggml.{k}_token_id": v for k, v in self.special.items()})
        out.update({f"tokenizer.ggml.{k}": v for k, v in self.flags.items()})
        if self.chat_template:
            out["tokenizer.chat_template"] = self.chat_template
        return out


def _walk(node, types: list[str], regexes: list[str]) -> None:
    """Collect the pre-tokenizer types and split regexes of a (nested) pre-tokenizer."""
    if isinstance(node, dict):
        if "type" in node:
            types.append(node["type"])
        if isinstance(node.get("pattern"), dict) and "Regex" in node["pattern"]:
            regexes.append(node["pattern"]["Regex"])
        for v in node.values():
            _walk(v, types, regexes)
    elif isinstance(node, list):
        for v in node:
            _walk(v, types, regexes)


def pre_tokenizer(spec: dict) -> str:
    types: list[str] = []
    regexes: list[str] = []
    _walk(spec.get("pre_tokenizer"), types, regexes)
    for name, kind, fragment in PRE_TOKENIZERS:
        if kind in types and (not fragment or any(fragment in r for r in regexes)):
            return name
    log.warning("unrecognised pre-tokenizer %s; writing llama.cpp's 'default'", types)
    return "default"


def _special_ids(tokenizer) -> dict[str, int]:
    names = {"bos": "bos_token_id", "eos": "eos_token_id", "unknown": "unk_token_id", "padding": "pad_token_id"}
    return {k: int(v) for k, attr in names.items() if (v := getattr(tokenizer, attr, None)) is not None}


def _flags(tokenizer, special: dict[str, int]) -> dict[str, bool]:
    """Whether encoding adds BOS/EOS, read from what the tokenizer does rather than from its settings."""
    ids = tokenizer("a").input_ids
    return {"add_bos_token": "bos" in special and ids[:1] == [special["bos"]],
            "add_eos_token": "eos" in special and len(ids) > 1 and ids[-1] == special["eos"]}


def _spm_prefix(spec: dict) -> bool:
    """SentencePiece's leading space: a Metaspace that prepends, or a normalizer that prepends '▁'."""
    text = json.dumps([spec.get("normalizer"), spec.get("pre_tokenizer")])
    return '"Prepend"' in text or ('"Metaspace"' in text and '"prepend_scheme": "never"' not in text)


def vocab_of(tokenizer, n_vocab: int) -> Vocab:
    """The GGUF vocabulary of ``tokenizer``, padded to the model's ``n_vocab`` embedding rows."""
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    model = spec["model"]
    kind = model["type"]
    sentencepiece = kind == "Unigram" or (kind == "BPE" and model.get("byte_fallback"))
    if kind not in ("BPE", "Unigram"):
        raise ValueError(f"--format gguf writes BPE and SentencePiece vocabularies, not a {kind} tokenizer")
    by_id = {i: t for t, i in tokenizer.get_vocab().items()}
    if max(by_id) >= n_vocab:
        raise ValueError(f"the tokenizer has id {max(by_id)} but the model embeds only {n_vocab} tokens")
    added = {t["id"]: t for t in spec.get("added_tokens", [])}
    special = _special_ids(tokenizer)
    unigram_scores = {i: s for i, (_, s) in enumerate(model["vocab"])} if kind == "Unigram" else {}
    tokens, types, scores = [], [], []
    for i in range(n_vocab):
        tok = by_id.get(i)
        if tok is None:
            tokens.append(f"[PAD{i}]")
            types.append(UNUSED)
        else:
            tokens.append(tok)
            if sentencepiece and i == special.get("unknown"):
                types.append(UNKNOWN)
            elif i in added:
                types.append(CONTROL if added[i].get("special") else USER_DEFINED)
            elif sentencepiece and _BYTE_TOKEN.match(tok):
                types.append(BYTE)
            else:
                types.append(NORMAL)
        # SentencePiece BPE ranks pieces by id: a lower id merges first, so its score is higher
        scores.append(float(unigram_scores.get(i, -i)))
    template = tokenizer.chat_template if isinstance(getattr(tokenizer, "chat_template", None), str) else None
    if sentencepiece:
        flags = {**_flags(tokenizer, special), "add_space_prefix": _spm_prefix(spec)}
        return Vocab("llama", None, tokens, types, scores=scores, special=special, flags=flags,
                     chat_template=template)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    return Vocab("gpt2", pre_tokenizer(spec), tokens, types, merges=merges, special=special,
                 flags=_flags(tokenizer, special), chat_template=template)
