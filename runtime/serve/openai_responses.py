"""OpenAI response shapes for runtime/serve/openai_routes.py: whole responses, streamed chunks, usage and the two
logprobs objects (legacy completions and chat)."""
from __future__ import annotations

import itertools
import time
import uuid

from runtime.sequence import TokenLogprob


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_logprobs(entries: list[TokenLogprob], strings: dict[int, str], offset: int = 0) -> dict:
    """OpenAI's legacy completions ``logprobs`` object; an entry with ``logprob=None`` is the unscored first
    prompt token. ``text_offset`` counts characters from ``offset``."""
    tokens = [strings[e.token_id] for e in entries]
    offsets = list(itertools.accumulate((len(t) for t in tokens[:-1]), initial=offset)) if tokens else []
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [None if e.logprob is None else {strings[t]: lp for t, lp in e.top} for e in entries],
            "text_offset": offsets}


def _token_info(token: str, logprob: float) -> dict:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}


def chat_logprobs(entries: list[TokenLogprob], strings: dict[int, str]) -> dict:
    """OpenAI's chat ``logprobs`` object: per token its logprob, bytes and ``top_logprobs`` alternatives."""
    return {"content": [{**_token_info(strings[e.token_id], e.logprob),
                         "top_logprobs": [_token_info(strings[t], lp) for t, lp in e.top]} for e in entries]}


def completion_choice(index: int, text: str, logprobs: dict | None, finish_reason: str | None) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def completion_body(rid: str, model: str, choices: list[dict], use: dict | None, chunk: bool) -> dict:
    """A /v1/completions response, or one streamed chunk of it."""
    body = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model, "choices": choices}
    if use is not None or not chunk:
        body["usage"] = use
    return body


def chat_choice(index: int, content: str | None, logprobs: dict | None, finish_reason: str | None,
                delta: dict | None = None, tool_calls: list[dict] | None = None) -> dict:
    """A chat choice: a whole ``message``, or (``delta`` given) one streamed piece of it."""
    choice = {"index": index, "logprobs": logprobs, "finish_reason": finish_reason}
    if delta is not None:
        return {**choice, "delta": delta}
    message = {"role": "assistant", "content": content}
    return {**choice, "message": {**message, "tool_calls": tool_calls} if tool_calls else message}


def chat_body(rid: str, model: str, choices: list[dict], use: dict | None) -> dict:
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model, "choices": choices,
            "usage": use}


def chat_chunk(rid: str, model: str, choices: list[dict]) -> dict:
    return {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
            "choices": choices}


def usage_chunk(rid: str, model: str, obj: str, use: dict) -> dict:
    """The final chunk ``stream_options.include_usage`` asks for: no choices, only usage."""
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": [], "usage": use}
