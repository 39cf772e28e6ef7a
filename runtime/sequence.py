"""Sampling parameters and the per-request state the scheduler and engine share (no torch)."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, NamedTuple

FINISH_REASONS = ("stop", "length", "abort")
MAX_LOGPROBS = 20  # top alternatives a request may ask for per token (OpenAI's limit)


class TokenLogprob(NamedTuple):
    """One token's log-probability and the ``top`` alternatives ``[(token_id, logprob), ...]``."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop (OpenAI/vLLM meanings).

    ``temperature=0`` is greedy; ``top_k=0`` and ``top_p=1`` switch those filters off;
    ``min_tokens`` suppresses EOS and ``stop_token_ids`` until that many tokens exist;
    ``stop`` strings end generation and are cut from the text; ``seed`` makes one request's
    sampling reproducible independently of the others (whatever else shares its batch).
    Penalties follow OpenAI/vLLM: ``presence_penalty``/``frequency_penalty`` subtract from the logits of
    tokens already generated (once / per occurrence), ``repetition_penalty`` divides positive (multiplies
    negative) logits of tokens in the prompt or output; ``logit_bias`` adds ``(token_id, bias)`` pairs;
    ``min_p`` drops tokens below ``min_p`` times the top probability. ``logprobs=k`` records each generated
    token's log-probability and the top ``k`` (0: the token only); ``prompt_logprobs=k`` the same for the
    prompt tokens (such a request skips the prefix cache: every prompt position must be computed).
    ``guide`` is a compiled grammar handle (runtime/guided.py) constraining every token.
    ``skip_special_tokens=False`` keeps special tokens in the text (a tool-call marker such as Mistral's
    ``[TOOL_CALLS]``); EOS and stop tokens never reach the text either way.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 64
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_p: float = 0.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    guide: Any = None
    skip_special_tokens: bool = True

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if not self.temperature >= 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0 (0 means greedy)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k} must be >= 0 (0 disables it)")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens} must be >= 1")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens={self.min_tokens} must be in [0, max_tokens={self.max_tokens}]")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop={self.stop!r} must hold non-empty strings")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids={self.stop_token_ids} must be non-negative token ids")
        object.__setattr__(self, "logit_bias", tuple((int(t), float(b)) for t, b in dict(self.logit_bias).items()))
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name}={getattr(self, name)} must be in [-2, 2]")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty={self.repetition_penalty} must be > 0 (1 disables it)")
        if any(not -100 <= b <= 100 for _, b in self.logit_bias):
            raise ValueError(f"logit_bias={dict(self.logit_bias)} biases must be in [-100, 100]")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p={self.min_p} must be in [0, 1] (0 disables it)")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and not 0 <= k <= MAX_LOGPROBS:
                raise ValueError(f"{name}={k} must be in [0, {MAX_LOGPROBS}]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1)

    @property
    def plain_only(self) -> bool:
        """Needs every token verified alone (penalties, bias, logprobs): no speculative drafts. A grammar's drafts
        are checked against it (runtime/guided.py)."""
        return bool(self.penalized or self.logit_bias or self.logprobs is not None or self.prompt_logprobs is not None)


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One request's tokens and bookkeeping; the block manager, scheduler and engine mutate it."""

    request_id: str
    token_ids: list[int]
    params: SamplingParams
    arrival_time: float = 0.0
    num_prompt_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose KV is in the target cache
    num_draft_computed: int = 0  # the same for the draft model's cache
    num_cached_tokens: int = 0  # prefix-cache hits at the last admission
    num_hashed_blocks: int = 0  # leading blocks of block_table registered in the prefix cache
    block_hashes: list[bytes] = field(default_factory=list)  # chained hashes of full blocks (token_ids only grows)
    num_preemptions: int = 0
    first_token_time: float | None = None
    finish_time: float | None = None
    finish_reason: str | None = None
    # detokenization
    output_text: str = ""
    num_emitted_chars: int = 0  # characters of output_text already streamed
    prefix_offset: int = 0  # offsets into detok_ids() for incremental decoding
    read_offset: int = 0
    num_emitted_tokens: int = 0  # completion tokens already streamed
    # logprobs (when the params ask): one per completion token, and one per prompt token after the first
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    guide_state: Any = None  # the request's grammar matcher (runtime/guided.py), advanced per accepted token

    def __post_init__(self):
        if not self.num_prompt_tokens:
            self.num_prompt_tokens = len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def last_token(self) -> int:
        return self.token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def is_decoding(self) -> bool:
        """All tokens but the last are in the cache: the next forward produces a new token."""
        return self.num_computed_tokens == self.num_tokens - 1
