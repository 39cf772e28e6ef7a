"""OpenAI-compatible HTTP server over the engine: /v1/completions, /v1/chat/completions, /v1/models,
/health and /metrics (Prometheus), with SSE streaming.

One background thread steps the engine (runtime/engine_loop.py); each request waits on its own
asyncio queue, so slow clients never stall the batch. A client that disconnects has its request
aborted and its KV blocks freed. With an API key every /v1 route needs ``Authorization: Bearer KEY``.
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from runtime.engine_loop import EngineLoop, QueueFull
from runtime.metrics import ServerMetrics
from runtime.openai_protocol import (APIError, ChatCompletionRequest, CompletionRequest, chat_body, chat_chunk,
                                     completion_body, new_id, usage, usage_chunk)

log = logging.getLogger(__name__)
DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default for /v1/completions


@dataclass(frozen=True)
class ServerConfig:
    """How the HTTP side behaves; the engine has its own EngineConfig."""

    model_name: str
    api_key: str | None = None
    max_queue: int = 256  # requests admitted beyond the running batch before answering 429
    max_num_seqs: int = 64

    def __post_init__(self):
        if self.max_queue < 0:
            raise ValueError(f"max_queue={self.max_queue} must be >= 0")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs={self.max_num_seqs} must be >= 1")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key is empty; pass a non-empty key or none")


class _BearerAuth:
    """ASGI middleware: /v1 routes need the API key before anything (even the body) is looked at."""

    def __init__(self, app, api_key: str):
        self.app, self.key = app, api_key.encode()

    def _ok(self, scope) -> bool:
        header = dict(scope.get("headers", [])).get(b"authorization", b"")
        scheme, _, token = header.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key)

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1") and not self._ok(scope):
            err = APIError(401, "missing or invalid API key; send 'Authorization: Bearer <key>'", type="authentication_error")
            await JSONResponse(err.body(), 401, headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)
            return
        await self.app(scope, receive, send)


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


def _sse(body: dict | str) -> str:
    return f"data: {body if isinstance(body, str) else json.dumps(body, ensure_ascii=False)}\n\n"


def _context_limit(engine) -> int | None:
    """The engine's max_model_len, wherever this engine version keeps it."""
    for holder in (engine, getattr(engine, "config", None)):
        value = getattr(holder, "max_model_len", None)
        if isinstance(value, int):
            return value
    return None


def _sampling_params_cls():
    from runtime.sequence import SamplingParams  # the engine's own; imported late to keep startup light

    return SamplingParams


def create_app(engine, config: ServerConfig) -> FastAPI:
    """The FastAPI app serving ``engine``; the engine thread runs for the app's lifespan."""
    metrics = ServerMetrics()
    loop_runner = EngineLoop(engine, max_pending=config.max_num_seqs + config.max_queue, metrics=metrics)
    served = {config.model_name, Path(config.model_name).name}
    SamplingParams = _sampling_params_cls()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        loop_runner.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            loop_runner.stop()

    app = FastAPI(title="compress", lifespan=lifespan)
    app.state.engine_loop = loop_runner
    app.state.metrics = metrics
    if config.api_key:
        app.add_middleware(_BearerAuth, api_key=config.api_key)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        if exc.status == 429:
            metrics.rejected.inc(reason="queue_full")
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        whole_body = [e for e in errors if e.get("type") == "json_invalid" or (
            tuple(e.get("loc", ())) == ("body",) and e.get("type") in ("model_attributes_type", "dict_type", "missing"))]
        if whole_body:  # not JSON, or JSON that is not an object: the body itself is malformed
            msg = f"request body must be a JSON object ({whole_body[0].get('msg')})"
            return JSONResponse(APIError(400, msg, param="body").body(), status_code=400)
        fields = [".".join(str(p) for p in e.get("loc", ()) if p != "body") or "body" for e in errors]
        message = "; ".join(f"{f}: {e.get('msg')}" for f, e in zip(fields, errors))
        return JSONResponse(APIError(422, message, param=fields[0] if fields else None).body(), status_code=422)

    def check_request(req) -> None:
        unknown = req.unknown_fields()
        if unknown:
            raise APIError(400, f"request field(s) {', '.join(unknown)} not supported by this server; remove them "
                           "(a dropped field would change the answer without telling you)", param=unknown[0])
        name = req.model
        if name and name not in served:
            raise APIError(404, f"model {name!r} is not served here; use {config.model_name!r}", param="model",
                           type="not_found_error")

    def submit(prompt, kwargs: dict, rid: str, param: str) -> asyncio.Queue:
        try:
            params = SamplingParams(**kwargs)
        except ValueError as e:
            raise APIError(400, str(e)) from None
        try:
            return loop_runner.submit(prompt, params, rid)
        except QueueFull as e:
            raise APIError(429, str(e), type="rate_limit_error") from None
        except ValueError as e:  # e.g. the prompt is longer than max_model_len
            raise APIError(400, str(e), param=param) from None

    async def next_or_disconnect(rid: str, queue: asyncio.Queue, request: Request):
        """The next item of ``queue``, checking every half second that the client is still there."""
        get = asyncio.ensure_future(queue.get())
        try:
            while not (await asyncio.wait({get}, timeout=0.5))[0]:
                if await request.is_disconnected():
                    loop_runner.abort(rid)
                    raise APIError(499, "client disconnected")
            return get.result()
        finally:
            get.cancel()  # no-op once done

    async def outputs(rid: str, queue: asyncio.Queue, request: Request | None) -> AsyncIterator:
        """The request's StepOutputs until it finishes; polls for a vanished client when not streaming."""
        while True:
            if request is None:  # streaming: the response itself notices a disconnect and cancels us
                item = await queue.get()
            else:
                item = await next_or_disconnect(rid, queue, request)
            if isinstance(item, BaseException):
                raise APIError(500, f"the engine failed: {item}", type="server_error")
            yield item
            if item.finished:
                return

    async def collect(rid: str, queue: asyncio.Queue, request: Request) -> tuple[str, str | None, dict]:
        text, finish, use = [], None, usage(0, 0)
        try:
            async for out in outputs(rid, queue, request):
                text.append(out.text_delta)
                finish, use = out.finish_reason, usage(out.prompt_tokens, out.completion_tokens)
        finally:
            loop_runner.abort(rid)  # no-op when it finished
        return "".join(text), finish, use

    async def stream_events(rid: str, queue: asyncio.Queue, chunk_of, obj: str, include_usage: bool):
        use = usage(0, 0)
        try:
            async for out in outputs(rid, queue, None):
                use = usage(out.prompt_tokens, out.completion_tokens)
                if out.text_delta or out.finished:
                    yield _sse(chunk_of(out.text_delta, out.finish_reason if out.finished else None))
        except APIError as e:
            yield _sse(e.body())
        if include_usage:
            yield _sse(usage_chunk(rid, config.model_name, obj, use))
        yield _sse("[DONE]")

    @app.get("/health")
    async def health():
        if not loop_runner.alive:
            return JSONResponse({"status": "engine thread is not running"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(metrics.render(engine.stats()), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        card = {"id": config.model_name, "object": "model", "created": 0, "owned_by": "compress"}
        limit = _context_limit(engine)
        if limit is not None:
            card["max_model_len"] = limit
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        check_request(req)
        if isinstance(req.prompt, list) and not all(0 <= t < len(engine.tokenizer) for t in req.prompt):
            raise APIError(400, f"prompt token ids must be in [0, {len(engine.tokenizer)})", param="prompt")
        rid = new_id("cmpl")
        queue = submit(req.prompt, req.sampling_kwargs(req.max_tokens or DEFAULT_COMPLETION_TOKENS), rid, "prompt")
        if req.stream:
            def chunk_of(text, finish):
                return completion_body(rid, config.model_name, text, finish, None, chunk=True)
            events = stream_events(rid, queue, chunk_of, "text_completion", req.include_usage)
            return _AbortOnClose(events, lambda: loop_runner.abort(rid))
        text, finish, use = await collect(rid, queue, request)
        return completion_body(rid, config.model_name, text, finish, use, chunk=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        check_request(req)
        tok = engine.tokenizer
        if not getattr(tok, "chat_template", None):
            raise APIError(400, "this model's tokenizer has no chat template; use /v1/completions", param="messages")
        try:
            text = tok.apply_chat_template(req.template_messages(), add_generation_prompt=True, tokenize=False)
        except Exception as e:  # jinja raises its own TemplateError for e.g. unsupported role orders
            raise APIError(400, f"the chat template rejected the messages: {e}", param="messages") from None
        ids = tok(text, add_special_tokens=False)["input_ids"]  # the template already placed special tokens
        max_tokens = req.requested_max_tokens
        if max_tokens is None:
            limit = _context_limit(engine)
            max_tokens = max(1, limit - len(ids)) if limit else 256
        rid = new_id("chatcmpl")
        queue = submit(ids, req.sampling_kwargs(max_tokens), rid, "messages")
        if req.stream:
            first = [True]

            def chunk_of(text, finish):
                delta = {"role": "assistant", "content": text} if first[0] else ({"content": text} if text else {})
                first[0] = False
                return chat_chunk(rid, config.model_name, delta, finish)
            events = stream_events(rid, queue, chunk_of, "chat.completion.chunk", req.include_usage)
            return _AbortOnClose(events, lambda: loop_runner.abort(rid))
        text, finish, use = await collect(rid, queue, request)
        return chat_body(rid, config.model_name, text, finish, use)

    return app


def serve(model: str, host: str = "127.0.0.1", port: int = 8000, draft: str | None = None, api_key: str | None = None,
          max_num_seqs: int = 64, max_queue: int = 256, max_model_len: int | None = None, dtype: str = "auto",
          device: str | None = None, lm_head: str = "auto", kv_cache_dtype: str = "auto", model_impl: str = "auto",
          trust_remote_code: bool = False) -> None:
    """Load ``model`` into an Engine and serve it until interrupted (the ``compress serve`` command)."""
    import torch
    import uvicorn

    from runtime.config import EngineConfig
    from runtime.engine import Engine

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    engine = Engine(EngineConfig(model=model, max_num_seqs=max_num_seqs, max_model_len=max_model_len, dtype=dtype,
                                 device=device, draft=draft, lm_head=lm_head, kv_cache_dtype=kv_cache_dtype,
                                 model_impl=model_impl, trust_remote_code=trust_remote_code))
    app = create_app(engine, ServerConfig(model_name=model, api_key=api_key, max_queue=max_queue,
                                          max_num_seqs=max_num_seqs))
    if host not in ("127.0.0.1", "localhost", "::1") and not api_key:
        log.warning("serving on %s without --api-key: anyone who can reach this address can use the model", host)
    uvicorn.run(app, host=host, port=port, log_level="info", timeout_graceful_shutdown=5)
