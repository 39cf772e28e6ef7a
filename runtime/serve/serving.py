"""One OpenAI request's life on the engine: its prompts x ``n`` choices submitted, their outputs gathered per
choice (text, logprobs, finish), or streamed as they come; a vanished client aborts every choice.

The routes in runtime/serve/server.py decide what a request means (prompt, params, response shape); this module
only moves engine outputs to them, so the two endpoints share one path for ``n``, echo, logprobs and streaming.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from fastapi import Request

from runtime.guided import Guide, Guides, GuideSpec
from runtime.sequence import SamplingParams, TokenLogprob
from runtime.serve.engine_loop import EngineLoop, QueueFull
from runtime.serve.openai_protocol import APIError
from runtime.serve.openai_responses import usage

log = logging.getLogger(__name__)


@dataclass
class Choice:
    """What one choice has produced so far."""

    index: int
    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    emitted: bool = False  # a streamed chunk of it has gone out
    sent_chars: int = 0  # text and logprobs already streamed (an output can add nothing sendable: half a character)
    sent_logprobs: int = 0

    def unsent_text(self) -> str:
        return "".join(self.text)[self.sent_chars:]

    def unsent_logprobs(self) -> list[TokenLogprob]:
        return self.logprobs[self.sent_logprobs:]

    def mark_sent(self) -> None:
        self.emitted, self.sent_chars, self.sent_logprobs = True, len("".join(self.text)), len(self.logprobs)


@dataclass
class Submitted:
    """A request's choices on the engine: request id -> choice index, all delivering into one queue."""

    rid: str
    n: int
    queue: asyncio.Queue
    index: dict[str, int]
    prompt_ids: list[list[int]]  # per prompt, for echo

    def usage(self, choices: list[Choice]) -> dict:
        prompt = sum(c.prompt_tokens for c in choices if c.index % self.n == 0)
        return usage(prompt, sum(c.completion_tokens for c in choices))


def choice_params(params: SamplingParams, j: int) -> SamplingParams:
    """The j-th choice of a prompt: its own seed (seed + j) and, past the first, no second prompt scoring."""
    if j == 0:
        return params
    return dataclasses.replace(params, seed=None if params.seed is None else params.seed + j, prompt_logprobs=None)


class RequestRunner:
    """Submits requests to the engine loop and turns their outputs into choices or stream events."""

    def __init__(self, engine, loop_runner: EngineLoop):
        self.engine, self.loop = engine, loop_runner
        self._guides: Guides | None = None
        self._guides_lock = threading.Lock()

    def guides(self) -> Guides:
        """The grammar compiler for the engine's tokenizer, built once (a few seconds: it reads the vocabulary)."""
        with self._guides_lock:
            if self._guides is None:
                e = self.engine
                self._guides = Guides(e.tokenizer, e.runner.vocab_size, e.eos_token_ids)
            return self._guides

    def warm(self) -> None:
        """Build the grammar compiler in the background, so the first guided request only compiles its grammar."""
        def build():
            try:
                self.guides()
            except Exception:  # xgrammar missing or the tokenizer unreadable: guided requests will say so
                log.warning("structured output is unavailable", exc_info=True)
        if self.engine.tokenizer is not None:
            threading.Thread(target=build, name="guides-warmup", daemon=True).start()

    async def compile_guide(self, asked: tuple[GuideSpec, str] | None) -> Guide | None:
        """The compiled grammar of a request's output constraint, off the event loop; 400 if it does not compile."""
        if asked is None:
            return None
        spec, field = asked
        if self.engine.tokenizer is None:
            raise APIError(400, f"{field} needs the model's tokenizer, and this model has none", param=field)
        try:
            return await asyncio.to_thread(lambda: self.guides().compile(spec))
        except ImportError:
            raise APIError(400, f"{field} needs the grammar engine; pip install xgrammar", param=field) from None
        except ValueError as e:
            raise APIError(400, f"{field}: {e}; fix it or drop the field", param=field) from None

    def submit(self, prompts: list, params: SamplingParams, n: int, rid: str, param: str) -> Submitted:
        """Queue ``n`` choices of each prompt; 429 when the server is full, 400 for a prompt it cannot take."""
        queue: asyncio.Queue = asyncio.Queue()
        sub = Submitted(rid, n, queue, {}, [])
        try:
            for i, prompt in enumerate(prompts):
                ids = [f"{rid}-{i * n + j}" for j in range(n)]
                ids_of_prompt = self.engine.encode(prompt) if isinstance(prompt, str) else list(prompt)
                self.loop.submit(ids_of_prompt, [choice_params(params, j) for j in range(n)], ids, queue)
                sub.index.update({r: i * n + j for j, r in enumerate(ids)})
                sub.prompt_ids.append(ids_of_prompt)
        except QueueFull as e:
            self.abort(sub)
            raise APIError(429, str(e), type="rate_limit_error") from None
        except ValueError as e:  # e.g. the prompt is longer than max_model_len
            self.abort(sub)
            raise APIError(400, str(e), param=param) from None
        return sub

    def abort(self, sub: Submitted) -> None:
        for r in sub.index:
            self.loop.abort(r)  # no-op for a finished choice

    async def _next(self, sub: Submitted, request: Request | None):
        """The next output; when not streaming, checks every half second that the client is still there."""
        if request is None:  # streaming: the response itself notices a disconnect and cancels us
            return await sub.queue.get()
        get = asyncio.ensure_future(sub.queue.get())
        try:
            while not (await asyncio.wait({get}, timeout=0.5))[0]:
                if await request.is_disconnected():
                    self.abort(sub)
                    raise APIError(499, "client disconnected")
            return get.result()
        finally:
            get.cancel()  # no-op once done

    async def outputs(self, sub: Submitted, request: Request | None) -> AsyncIterator:
        """``(choice index, StepOutput)`` until every choice has finished."""
        left = len(sub.index)
        while left:
            item = await self._next(sub, request)
            if isinstance(item, BaseException):
                raise APIError(500, f"the engine failed: {item}", type="server_error")
            left -= item.finished
            yield sub.index[item.request_id], item

    async def collect(self, sub: Submitted, request: Request) -> list[Choice]:
        """Every choice, finished (aborting all of them if the client goes away)."""
        choices = [Choice(i) for i in range(len(sub.index))]
        try:
            async for i, out in self.outputs(sub, request):
                add(choices[i], out)
        finally:
            self.abort(sub)
        return choices

    async def stream(self, sub: Submitted, chunk_of: Callable, usage_chunk: Callable | None) -> AsyncIterator[dict]:
        """Stream bodies: ``chunk_of(choice, out)`` after each output, a body or a list of them (None or [] to send
        nothing yet: what the choice has not sent goes with its next chunk), then the usage chunk if asked."""
        choices = [Choice(i) for i in range(len(sub.index))]
        try:
            async for i, out in self.outputs(sub, None):
                add(choices[i], out)
                bodies = chunk_of(choices[i], out)
                bodies = [bodies] if isinstance(bodies, dict) else bodies or []
                if bodies:
                    choices[i].mark_sent()
                for body in bodies:
                    yield body
        except APIError as e:
            yield e.body()
        if usage_chunk is not None:
            yield usage_chunk(sub.usage(choices))


def add(choice: Choice, out) -> None:
    """Fold one StepOutput into its choice."""
    choice.text.append(out.text_delta)
    choice.logprobs += out.logprobs or []
    if out.prompt_logprobs is not None:
        choice.prompt_logprobs = out.prompt_logprobs
    choice.prompt_tokens, choice.completion_tokens = out.prompt_tokens, out.completion_tokens
    if out.finished:
        choice.finish_reason = out.finish_reason
