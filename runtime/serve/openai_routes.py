"""The two generation endpoints: what a completions or chat request asks of the engine, and the OpenAI response
(whole, or streamed as server-sent events) built from its choices: text, ``n``, echo and logprobs.

Logprobs are those of the distribution each token was drawn from before truncation: the logits after
penalties, ``logit_bias`` and any grammar mask, at the request's temperature (1 when greedy); prompt
logprobs (completions ``echo`` with ``logprobs``) are the model's own, unprocessed. ``max_tokens: 0`` with
``echo`` scores the prompt and returns no generated text (lm-eval's loglikelihood requests send 1 and drop it).
"""
from __future__ import annotations

import json
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import StreamingResponse

from runtime.serve import tool_calls
from runtime.guided import GuideSpec
from runtime.serve.openai_protocol import (APIError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                     TokenizeRequest, check_logprobs)
from runtime.serve.openai_responses import (chat_body, chat_choice, chat_chunk, chat_logprobs, completion_body,
                                      completion_choice, completion_logprobs, new_id, usage_chunk)
from runtime.sequence import SamplingParams, TokenLogprob
from runtime.serve.serving import Choice, RequestRunner, Submitted
from runtime.serve.tool_calls import ToolFormat

DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default for /v1/completions


class _AbortOnClose(StreamingResponse):
    """A streaming response that aborts its request however the stream ends (done, error, disconnect)."""

    def __init__(self, content, on_close):
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


async def _sse(bodies: AsyncIterator[dict]) -> AsyncIterator[str]:
    async for body in bodies:
        yield f"data: {json.dumps(body, ensure_ascii=False)}\n\n"
    yield "data: [DONE]\n\n"


async def guide_for(runner: RequestRunner, req):
    try:
        asked = req.guide_spec()
    except ValueError as e:
        raise APIError(400, str(e), param="response_format") from None
    return await runner.compile_guide(asked)


def sampling_params(req, max_tokens: int, vocab: int, **extra) -> SamplingParams:
    """The engine's params for ``req``; 400 naming the field for a value the engine refuses."""
    outside = [t for t in (req.logit_bias or {}) if not 0 <= t < vocab]
    if outside:
        raise APIError(400, f"logit_bias names token id {outside[0]}, outside this model's vocabulary [0, {vocab}); "
                       "remove it", param="logit_bias")
    try:
        return SamplingParams(**req.sampling_kwargs(max_tokens), **extra)
    except ValueError as e:
        raise APIError(400, str(e)) from None


class _CompletionShape:
    """Builds /v1/completions choices (echo, logprobs, scoring-only) for one submitted request."""

    def __init__(self, engine, req: CompletionRequest, sub: Submitted, model: str, score_only: bool):
        self.engine, self.req, self.sub, self.model, self.score_only = engine, req, sub, model, score_only
        prompts = req.prompts
        self.prompt_text = [p if isinstance(p, str) else engine.decode(p) for p in prompts] if req.echo else None
        self.scored: dict[int, list[TokenLogprob]] = {}  # prompt -> its logprobs (only its first choice scores it)

    def _entries(self, c: Choice, generated: list[TokenLogprob], first: bool) -> list[TokenLogprob]:
        """Logprob entries: the generated ones, after the echoed prompt's when the choice starts."""
        generated = [] if self.score_only else list(generated)
        if not (self.req.echo and first):
            return generated
        i = c.index // self.sub.n
        if c.prompt_logprobs is not None:
            self.scored[i] = c.prompt_logprobs
        prompt = self.sub.prompt_ids[i]
        return [TokenLogprob(prompt[0], None, [])] + list(self.scored.get(i, [])) + generated

    def _logprobs(self, entries: list[TokenLogprob], offset: int) -> dict | None:
        if self.req.logprobs is None:
            return None
        strings = self.engine.token_strings([e.token_id for e in entries] + [t for e in entries for t, _ in e.top])
        return completion_logprobs(entries, strings, offset)

    def _echo(self, choice: Choice) -> str:
        return self.prompt_text[choice.index // self.sub.n] if self.req.echo else ""

    def choice(self, c: Choice) -> dict:
        text = self._echo(c) + ("" if self.score_only else "".join(c.text))
        return completion_choice(c.index, text, self._logprobs(self._entries(c, c.logprobs, True), 0), c.finish_reason)

    def chunk(self, c: Choice, out) -> dict | None:
        first = not c.emitted
        text = (self._echo(c) if first else "") + ("" if self.score_only else c.unsent_text())
        if not text and not out.finished:
            return None
        offset = 0 if first else len(self._echo(c)) + c.sent_chars
        finish = out.finish_reason if out.finished else None
        choice = completion_choice(c.index, text, self._logprobs(self._entries(c, c.unsent_logprobs(), first), offset),
                                   finish)
        return completion_body(self.sub.rid, self.model, [choice], None, chunk=True)


def _score_only_usage(use: dict) -> dict:
    return {**use, "completion_tokens": 0, "total_tokens": use["prompt_tokens"]}


async def completions(engine, runner: RequestRunner, req: CompletionRequest, request: Request, model: str):
    prompts, vocab = req.prompts, engine.runner.vocab_size
    if any(isinstance(p, list) and not all(0 <= t < vocab for t in p) for p in prompts):
        raise APIError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
    max_tokens = DEFAULT_COMPLETION_TOKENS if req.max_tokens is None else req.max_tokens
    k = req.logprobs
    check_logprobs(k, "logprobs")
    params = sampling_params(req, max(max_tokens, 1), vocab, logprobs=k, prompt_logprobs=k if req.echo else None,
                             guide=await guide_for(runner, req))
    sub = runner.submit(prompts, params, req.n, new_id("cmpl"), "prompt")
    shape = _CompletionShape(engine, req, sub, model, score_only=max_tokens == 0)
    if req.stream:
        def final(use):
            return usage_chunk(sub.rid, model, "text_completion", _score_only_usage(use) if shape.score_only else use)
        events = runner.stream(sub, shape.chunk, final if req.include_usage else None)
        return _AbortOnClose(_sse(events), lambda: runner.abort(sub))
    choices = await runner.collect(sub, request)
    use = sub.usage(choices)
    return completion_body(sub.rid, model, [shape.choice(c) for c in choices],
                           _score_only_usage(use) if shape.score_only else use, chunk=False)


def chat_prompt(engine, req: ChatCompletionRequest | TokenizeRequest) -> list[int]:
    """The messages through the model's chat template, as token ids."""
    tok = engine.tokenizer
    if not getattr(tok, "chat_template", None):
        raise APIError(400, "this model's tokenizer has no chat template; use /v1/completions", param="messages")
    try:
        tools = req.tool_dicts() if getattr(req, "tools_active", False) else None
        text = tok.apply_chat_template(req.template_messages(), tools=tools, tokenize=False,
                                       add_generation_prompt=getattr(req, "add_generation_prompt", True))
    except Exception as e:  # jinja raises its own TemplateError for e.g. unsupported role orders
        raise APIError(400, f"the chat template rejected the messages: {e}", param="messages") from None
    return list(tok(text, add_special_tokens=False)["input_ids"])  # the template already placed special tokens


def tool_guide(req: ChatCompletionRequest, fmt: ToolFormat) -> tuple[GuideSpec, str] | None:
    """The constraint of tool_choice "required" or a named function, checked against the tools offered."""
    if req.tool_choice not in (None, "none", "auto") and not req.tools:
        raise APIError(400, "tool_choice needs tools; send the tools or drop tool_choice", param="tool_choice")
    if not req.tools_active or req.tool_choice in (None, "auto"):
        return None
    names = [t.function.name for t in req.tools]
    if req.named_tool is not None and req.named_tool not in names:
        raise APIError(400, f"tool_choice names function {req.named_tool!r}, which is not among the tools {names}; "
                       "name one of them", param="tool_choice")
    return tool_calls.guide_spec(req.tool_dicts(), fmt, req.named_tool), "tool_choice"


async def chat_guide(runner: RequestRunner, req: ChatCompletionRequest, fmt: ToolFormat):
    tool = tool_guide(req, fmt)
    if tool is None:
        return await guide_for(runner, req)
    if req.guide_spec() is not None:
        raise APIError(400, "tool_choice and response_format both constrain the output; send one", param="tool_choice")
    return await runner.compile_guide(tool)


def _message(c: Choice, req: ChatCompletionRequest, fmt: ToolFormat) -> tuple[str | None, list | None, str | None]:
    """A finished choice's content, parsed tool calls (when tools are on) and finish reason."""
    text = "".join(c.text)
    if not req.tools_active:
        return text, None, c.finish_reason
    content, calls = tool_calls.parse(text, fmt)
    calls = calls if req.parallel_tool_calls else calls[:1]
    return content, calls or None, "tool_calls" if calls and c.finish_reason == "stop" else c.finish_reason


async def chat(engine, runner: RequestRunner, req: ChatCompletionRequest, request: Request, model: str,
               fmt: ToolFormat):
    ids = chat_prompt(engine, req)
    max_tokens = req.requested_max_tokens
    if max_tokens is None:
        limit = getattr(engine, "max_model_len", None)
        max_tokens = max(1, limit - len(ids)) if isinstance(limit, int) else 256
    check_logprobs(req.top_logprobs, "top_logprobs")
    top = (req.top_logprobs or 0) if req.logprobs else None
    guide = await chat_guide(runner, req, fmt)
    params = sampling_params(req, max_tokens, engine.runner.vocab_size, logprobs=top, guide=guide)
    sub = runner.submit([ids], params, req.n, new_id("chatcmpl"), "messages")

    def logprobs(entries: list[TokenLogprob]) -> dict | None:
        if top is None:
            return None
        return chat_logprobs(entries, engine.token_strings([e.token_id for e in entries] +
                                                           [t for e in entries for t, _ in e.top]))

    def final(use):
        return usage_chunk(sub.rid, model, "chat.completion.chunk", use) if req.include_usage else None

    if req.stream and req.tools_active:  # calls are parsed from the whole output: one chunk per choice at its end
        return _AbortOnClose(_sse(_whole_chunks(runner, sub, req, fmt, model, logprobs, final)),
                             lambda: runner.abort(sub))
    if req.stream:
        def chunk_of(c: Choice, out) -> dict | None:
            text = c.unsent_text()
            delta = {"role": "assistant", "content": text} if not c.emitted else ({"content": text} if text else {})
            if not delta and not out.finished:
                return None
            finish = out.finish_reason if out.finished else None
            choice = chat_choice(c.index, "", logprobs(c.unsent_logprobs()), finish, delta=delta)
            return chat_chunk(sub.rid, model, [choice])
        events = runner.stream(sub, chunk_of, final if req.include_usage else None)
        return _AbortOnClose(_sse(events), lambda: runner.abort(sub))
    choices, body = await runner.collect(sub, request), []
    for c in choices:
        content, calls, finish = _message(c, req, fmt)
        body.append(chat_choice(c.index, content, logprobs(c.logprobs), finish, tool_calls=calls))
    return chat_body(sub.rid, model, body, sub.usage(choices))


async def _whole_chunks(runner, sub, req, fmt, model, logprobs, final):
    try:
        choices = await runner.collect(sub, None)
    except APIError as e:
        yield e.body()
        return
    for c in choices:
        content, calls, finish = _message(c, req, fmt)
        delta = {"role": "assistant", "content": content}
        if calls:
            delta["tool_calls"] = [{"index": k, **call} for k, call in enumerate(calls)]
        yield chat_chunk(sub.rid, model, [chat_choice(c.index, None, logprobs(c.logprobs), finish, delta=delta)])
    if final(sub.usage(choices)) is not None:
        yield final(sub.usage(choices))


def tokenize(engine, req: TokenizeRequest, max_model_len: int | None) -> dict:
    """vLLM's /tokenize answer."""
    if engine.tokenizer is None:
        raise APIError(400, "this model has no tokenizer; send token ids", param="prompt")
    if req.messages is not None:
        ids = chat_prompt(engine, req)
    else:
        ids = engine.encode(req.prompt, add_special_tokens=req.add_special_tokens is not False)
    strs = engine.token_strings(ids) if req.return_token_strs else None
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids,
            "token_strs": [strs[t] for t in ids] if strs else None}


def detokenize(engine, req: DetokenizeRequest) -> dict:
    vocab = engine.runner.vocab_size
    if any(not 0 <= t < vocab for t in req.tokens):
        raise APIError(400, f"tokens must be ids in [0, {vocab})", param="tokens")
    return {"prompt": engine.decode(req.tokens)}


def tokenizer_info(engine) -> dict:
    """What lm-eval's remote tokenizer reads (special tokens and the chat template)."""
    tok = engine.tokenizer
    if tok is None:
        raise APIError(404, "this model has no tokenizer", type="not_found_error")
    return {"tokenizer_class": type(tok).__name__, "eos_token": tok.eos_token, "bos_token": tok.bos_token,
            "pad_token": tok.pad_token, "chat_template": getattr(tok, "chat_template", None),
            "model_max_length": getattr(engine, "max_model_len", None)}
