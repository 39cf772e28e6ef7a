"""OpenAI-compatible HTTP server over the engine: /v1/completions, /v1/chat/completions, /v1/models,
/health and /metrics (Prometheus), with SSE streaming.

One background thread steps the engine (runtime/serve/engine_loop.py); each request waits on its own
asyncio queue, so slow clients never stall the batch. A client that disconnects has its request
aborted and its KV blocks freed. With an API key every /v1 route needs ``Authorization: Bearer KEY``.
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse

from runtime.serve import openai_routes as routes
from runtime.serve.engine_loop import EngineLoop
from runtime.serve.metrics import ServerMetrics
from runtime.serve.openai_protocol import (APIError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                     TokenizeRequest)
from runtime.serve.serving import RequestRunner
from runtime.serve.tool_calls import FORMATS

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerConfig:
    """How the HTTP side behaves; the engine has its own EngineConfig."""

    model_name: str
    api_key: str | None = None
    served_model_names: tuple[str, ...] = ()  # the names requests may use; default: model_name and its folder name
    tool_call_parser: str = "hermes"  # how the model writes tool calls: a runtime/serve/tool_calls.py FORMATS name
    max_queue: int = 256  # requests admitted beyond the running batch before answering 429
    max_num_seqs: int = 64

    def __post_init__(self):
        if self.max_queue < 0:
            raise ValueError(f"max_queue={self.max_queue} must be >= 0")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs={self.max_num_seqs} must be >= 1")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key is empty; pass a non-empty key or none")
        if self.tool_call_parser not in FORMATS:
            raise ValueError(f"tool_call_parser={self.tool_call_parser!r} is unknown; use one of {sorted(FORMATS)}")
        if any(not n or not n.strip() for n in self.served_model_names):
            raise ValueError(f"served_model_names={self.served_model_names!r} holds an empty name")

    @property
    def names(self) -> tuple[str, ...]:
        """Names a request's ``model`` may use; the first is the one responses carry."""
        return tuple(self.served_model_names) or (self.model_name, Path(self.model_name).name)


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


def _context_limit(engine) -> int | None:
    """The engine's max_model_len, wherever this engine version keeps it."""
    for holder in (engine, getattr(engine, "config", None)):
        value = getattr(holder, "max_model_len", None)
        if isinstance(value, int):
            return value
    return None


def create_app(engine, config: ServerConfig) -> FastAPI:
    """The FastAPI app serving ``engine``; the engine thread runs for the app's lifespan."""
    metrics = ServerMetrics(model_name=config.names[0])
    loop_runner = EngineLoop(engine, max_pending=config.max_num_seqs + config.max_queue, metrics=metrics)
    runner = RequestRunner(engine, loop_runner)
    names = config.names
    model = names[0]

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        loop_runner.start(asyncio.get_running_loop())
        runner.warm()
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
        if req.model and req.model not in names:
            raise APIError(404, f"model {req.model!r} is not served here; use one of {list(dict.fromkeys(names))}",
                           param="model", type="not_found_error")

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
        limit = _context_limit(engine)
        cards = [{"id": name, "object": "model", "created": 0, "owned_by": "compress", "root": config.model_name,
                  **({"max_model_len": limit} if limit is not None else {})}
                 for name in (config.served_model_names or (config.model_name,))]
        return {"object": "list", "data": cards}

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        check_request(req)
        return routes.tokenize(engine, req, _context_limit(engine))

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        check_request(req)
        return routes.detokenize(engine, req)

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        return routes.tokenizer_info(engine)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        check_request(req)
        return await routes.completions(engine, runner, req, request, model)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        check_request(req)
        return await routes.chat(engine, runner, req, request, model, FORMATS[config.tool_call_parser])

    return app


def read_chat_template(value: str) -> str:
    """``--chat-template``: a file's text, or the value itself when it is a template (a Jinja template has "{")."""
    if "{" in value:
        return value
    if not Path(value).is_file():
        raise FileNotFoundError(f"--chat-template {value!r} is neither a file nor a Jinja template; give one")
    return Path(value).read_text()


def serve(model: str, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None, max_queue: int = 256,
          served_model_names: tuple[str, ...] = (), chat_template: str | None = None, tool_call_parser: str = "hermes",
          **engine_options) -> None:
    """Load ``model`` into an Engine and serve it until interrupted (the ``compress serve`` command).

    ``engine_options`` are EngineConfig fields (max_num_seqs, block_size, kv_cache_memory, ...); ``chat_template``
    is a Jinja file or the template itself, replacing the tokenizer's own."""
    import torch
    import uvicorn

    from runtime.config import EngineConfig
    from runtime.engine import Engine

    engine_options.setdefault("device", "cuda" if torch.cuda.is_available() else "cpu")
    engine = Engine(EngineConfig(model=model, **engine_options))
    if chat_template is not None:
        if engine.tokenizer is None:
            raise ValueError("--chat-template given but the model has no tokenizer")
        engine.tokenizer.chat_template = read_chat_template(chat_template)
    app = create_app(engine, ServerConfig(model_name=model, api_key=api_key, max_queue=max_queue,
                                          max_num_seqs=engine.config.max_num_seqs,
                                          served_model_names=tuple(served_model_names),
                                          tool_call_parser=tool_call_parser))
    if host not in ("127.0.0.1", "localhost", "::1") and not api_key:
        log.warning("serving on %s without --api-key: anyone who can reach this address can use the model", host)
    uvicorn.run(app, host=host, port=port, log_level="info", timeout_graceful_shutdown=5)
