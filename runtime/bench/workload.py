"""Synthetic benchmark requests: token prompts of ragged lengths cut from a built-in passage.

Plain requests start at random offsets of the passage (so prefix caching cannot share them).
Prompt-grounded requests ask the model to repeat a passage the prompt contains and begin the copy,
so a good model's continuation is text already in the prompt: what n-gram drafting exploits.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass

# Plain prose written for this benchmark; its only job is to tokenize into varied, natural text.
PASSAGE = (
    "The river left the mountains in late spring, carrying snowmelt through a valley of birch and stone. "
    "Farmers along its banks measured the season by the colour of the water, grey in April and green by June. "
    "A small town grew where the current slowed, first a mill, then a bridge, then a market on Saturdays. "
    "Children learned to swim in the shallow bend below the church and to fear the deep pool past the willows. "
    "In the archive above the post office a clerk kept ledgers of every flood since the bridge was built. "
    "The worst year, the ledgers say, the water reached the third step of the town hall and stayed for a week. "
    "Engineers came after that, with plans for a wall, a spillway and a reservoir high in the hills. "
    "Only the spillway was finished; the money ran out before the wall, and the reservoir stayed a drawing. "
    "Now the spillway is a place for herons, and the drawings hang framed in the library by the stairs. "
    "Visitors ask why the town never moved to higher ground, and the answer is always the same: the river. "
    "It brought the grain barges, then the timber trade, then the tourists who come for the autumn light. "
    "Every evening the bells ring six times, and the baker closes the shutters while the swallows gather. "
    "A mathematician who retired there wrote a short book about the river's meanders and their slow drift. "
    "She showed that each bend moves a few centimetres a year, so the map in the square is always wrong. "
    "The town council voted to keep the old map anyway, because the wrong map is part of the town now. "
    "On the last day of summer there is a race of paper boats from the bridge to the spillway. "
    "Most boats sink near the mill, a few reach the willows, and one or two each year are never found. "
    "The winner gets a loaf of bread, a jar of honey and the right to ring the bells the next morning. "
)
INSTRUCTION = "Repeat the following passage exactly, word for word.\n\n"
SEPARATOR = "\n\nRepeat:\n"


@dataclass(frozen=True)
class Request:
    prompt_ids: tuple[int, ...]
    output_len: int


def _ids(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _length(rng: random.Random, top: int, jitter: float) -> int:
    return rng.randint(max(1, math.ceil(top * (1 - jitter))), top)


def make_requests(tokenizer, n: int, prompt_len: int, output_len: int, jitter: float, seed: int,
                  grounded: bool = False) -> list[Request]:
    """``n`` requests; prompt and output lengths drawn uniformly from ``[len * (1 - jitter), len]``."""
    rng = random.Random(seed)
    corpus = _ids(tokenizer, PASSAGE)
    corpus = corpus * math.ceil(2 * (prompt_len + 1) / len(corpus) + 1)  # long enough for any window
    instr, sep = _ids(tokenizer, INSTRUCTION), _ids(tokenizer, SEPARATOR)
    out = []
    for _ in range(n):
        p, o = max(2, _length(rng, prompt_len, jitter)), _length(rng, output_len, jitter)
        off = rng.randrange(len(corpus) // 2)
        if not grounded:
            prompt = corpus[off:off + p]
        else:
            frame = instr + sep if p >= 2 * len(instr + sep) else []
            room = p - len(frame)
            shown = room - room // 4  # the passage, then its first quarter again: the copy has begun
            passage = corpus[off:off + shown]
            begun = passage[:room - shown]
            prompt = (frame[:len(instr)] + passage + frame[len(instr):] + begun) if frame else passage + begun
        assert len(prompt) == p, (len(prompt), p)
        out.append(Request(tuple(prompt), o))
    return out
