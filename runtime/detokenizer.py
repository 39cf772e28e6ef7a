"""Incremental detokenization and stop-string handling for one sequence at a time."""
from __future__ import annotations

from runtime.sequence import Sequence

PREFIX_TOKENS = 5  # prompt tokens decoded alongside the output so leading spaces come out right


def init_offsets(seq: Sequence) -> None:
    seq.prefix_offset = max(seq.num_prompt_tokens - PREFIX_TOKENS, 0)
    seq.read_offset = seq.num_prompt_tokens


def decode_new_text(tokenizer, seq: Sequence) -> str:
    """Text added by the tokens appended since the last call (held back while a character is incomplete)."""
    ids, skip = seq.token_ids, seq.params.skip_special_tokens
    prefix = tokenizer.decode(ids[seq.prefix_offset:seq.read_offset], skip_special_tokens=skip)
    full = tokenizer.decode(ids[seq.prefix_offset:], skip_special_tokens=skip)
    if len(full) > len(prefix) and not full.endswith("\ufffd"):
        seq.prefix_offset, seq.read_offset = seq.read_offset, len(ids)
        return full[len(prefix):]
    return ""


def find_stop(text: str, new_chars: int, stops: tuple[str, ...]) -> int | None:
    """Index where the earliest stop string starts, looking only where the last ``new_chars`` could complete one."""
    if not stops:
        return None
    longest = max(len(s) for s in stops)
    lo = max(0, len(text) - new_chars - longest + 1)
    hits = [i for i in (text.find(s, lo) for s in stops) if i != -1]
    return min(hits) if hits else None


def pending_text(seq: Sequence, finished: bool) -> str:
    """Text not yet streamed; while running, keep back what could still become a stop string."""
    stops = seq.params.stop
    hold = 0 if finished or not stops else max(len(s) for s in stops) - 1
    end = max(seq.num_emitted_chars, len(seq.output_text) - hold)
    delta = seq.output_text[seq.num_emitted_chars:end]
    seq.num_emitted_chars = end
    return delta
