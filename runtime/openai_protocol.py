"""OpenAI-compatible request bodies and response shapes for runtime/server.py.

Requests are pydantic models (FastAPI turns a wrong type into a 422 naming the field); the OpenAI
sampling fields plus vLLM's extensions (``top_k``, ``min_tokens``, ``ignore_eos``, ``seed``,
``stop_token_ids``) map onto the engine's ``SamplingParams``. A field we do not implement is refused
with 400 naming it (``unknown_fields``), never dropped, so a client never silently gets something it
did not ask for; the only fields accepted and ignored are the bookkeeping ones in ``IGNORED_FIELDS``.
"""
from __future__ import annotations

import logging
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

log = logging.getLogger(__name__)


# Fields clients send by default that cannot change the output: accepted and ignored (everything else
# unknown is a 400). ``user``/``stream_options`` are declared on the request models themselves.
IGNORED_FIELDS = ("metadata", "store", "service_tier", "parallel_tool_calls", "prompt_cache_key", "safety_identifier")
IGNORED_MESSAGE_FIELDS = ("name",)


class APIError(Exception):
    """An error the client caused or must handle, rendered as OpenAI's ``{"error": {...}}``."""

    def __init__(self, status: int, message: str, param: str | None = None, type: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.type = status, message, param, type

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.status}}


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(BaseModel):
    """Fields shared by both endpoints."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1)  # vLLM: -1 (or 0) disables
    min_tokens: int = Field(default=0, ge=0)
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: Any = None
    user: str | None = None

    @model_validator(mode="after")
    def _supported(self):
        unsupported = {
            "n": self.n != 1, "presence_penalty": self.presence_penalty != 0,
            "frequency_penalty": self.frequency_penalty != 0, "logprobs": self.logprobs not in (None, False, 0),
        }
        for field, bad in unsupported.items():
            if bad:
                raise ValueError(f"{field}={getattr(self, field)!r} is not supported by this server; leave it at its default")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens={self.min_tokens} exceeds max_tokens={self.max_tokens}; lower min_tokens")
        return self

    def unknown_fields(self) -> list[str]:
        """Request fields this server does not implement (the caller answers 400 naming them)."""
        names = [k for k in (self.model_extra or {}) if k not in IGNORED_FIELDS]
        for i, m in enumerate(getattr(self, "messages", ())):
            names += [f"messages[{i}].{k}" for k in (m.model_extra or {}) if k not in IGNORED_MESSAGE_FIELDS]
        return names

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling_kwargs(self, max_tokens: int) -> dict:
        """Keyword arguments for the engine's ``SamplingParams``."""
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return dict(temperature=self.temperature, top_p=self.top_p, top_k=max(self.top_k, 0), max_tokens=max_tokens,
                    min_tokens=self.min_tokens, stop=stop, stop_token_ids=tuple(self.stop_token_ids or ()),
                    ignore_eos=self.ignore_eos, seed=self.seed)


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    suffix: str | None = None

    @model_validator(mode="after")
    def _single_prompt(self):
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise ValueError(f"prompt holds {len(p)} prompts; this server takes one prompt per request")
            self.prompt = p[0]
        if self.echo or self.suffix:
            raise ValueError("echo and suffix are not supported by this server; leave them unset")
        if isinstance(self.prompt, (str, list)) and len(self.prompt) == 0:
            raise ValueError("prompt is empty; send at least one token of text")
        return self


class ContentPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)

    def template_messages(self) -> list[dict]:
        """Messages as a chat template expects them (``developer`` is OpenAI's new name for ``system``)."""
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in self.messages]

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_body(rid: str, model: str, text: str, finish_reason: str | None, use: dict | None, chunk: bool) -> dict:
    """A /v1/completions response, or one streamed chunk of it."""
    body = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}]}
    if use is not None or not chunk:
        body["usage"] = use
    return body


def chat_body(rid: str, model: str, text: str, finish_reason: str | None, use: dict | None) -> dict:
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                         "finish_reason": finish_reason}],
            "usage": use}


def chat_chunk(rid: str, model: str, delta: dict, finish_reason: str | None) -> dict:
    return {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]}


def usage_chunk(rid: str, model: str, obj: str, use: dict) -> dict:
    """The final chunk ``stream_options.include_usage`` asks for: no choices, only usage."""
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": [], "usage": use}
