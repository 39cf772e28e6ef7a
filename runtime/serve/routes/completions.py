"""/v1/completions: a request's prompts through the engine, and the OpenAI response (whole, or streamed as
server-sent events) built from its choices: text, ``n``, echo and logprobs (see routes/generation.py).
``max_tokens: 0`` with ``echo`` scores the prompt and returns no generated text (lm-eval's loglikelihood requests
send 1 and drop it)."""
from __future__ import annotations

from fastapi import APIRouter, Request

from runtime.sequence import TokenLogprob
from runtime.serve.openai_protocol import APIError, CompletionRequest, check_logprobs
from runtime.serve.openai_responses import (completion_body, completion_choice, completion_logprobs, new_id,
                                            usage_chunk)
from runtime.serve.routes.generation import AbortOnClose, guide_for, sampling_params, sse
from runtime.serve.serving import Choice, Submitted
from runtime.serve.state import served

DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default for /v1/completions

router = APIRouter()


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


@router.post("/v1/completions")
async def completions(req: CompletionRequest, request: Request):
    s = served(request)
    s.check(req)
    engine, runner, model = s.engine, s.runner, s.model
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
        return AbortOnClose(sse(events), lambda: runner.abort(sub))
    choices = await runner.collect(sub, request)
    use = sub.usage(choices)
    return completion_body(sub.rid, model, [shape.choice(c) for c in choices],
                           _score_only_usage(use) if shape.score_only else use, chunk=False)
