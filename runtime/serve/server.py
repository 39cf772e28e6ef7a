"""OpenAI-compatible HTTP server over the engine: /v1/completions, /v1/chat/completions, /v1/models,
/health and /metrics (Prometheus), with SSE streaming.

One background thread steps the engine (runtime/serve/engine_loop.py); each request waits on its own
asyncio queue, so slow clients never stall the batch. A client that disconnects has its request
aborted and its KV blocks freed. With an API key every /v1 route needs ``Authorization: Bearer KEY``.
The routes are in routes/ (one module per concern), the state they share in state.py.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path

from fastapi import FastAPI

from runtime.serve.auth import BearerAuth
from runtime.serve.config import ServerConfig
from runtime.serve.engine_loop import EngineLoop
from runtime.serve.errors import HANDLERS
from runtime.serve.metrics import ServerMetrics
from runtime.serve.routes import ROUTERS
from runtime.serve.serving import RequestRunner
from runtime.serve.state import ServeState

__all__ = ["ServerConfig", "create_app", "read_chat_template", "serve"]
log = logging.getLogger(__name__)


@contextlib.asynccontextmanager
async def _lifespan(app: FastAPI):
    """The engine thread runs while the app does; the guided-decoding compiler warms up at start."""
    state: ServeState = app.state.serve
    state.loop.start(asyncio.get_running_loop())
    state.runner.warm()
    try:
        yield
    finally:
        state.loop.stop()


def create_app(engine, config: ServerConfig) -> FastAPI:
    """The FastAPI app serving ``engine``; the engine thread runs for the app's lifespan."""
    metrics = ServerMetrics(model_name=config.names[0])
    loop = EngineLoop(engine, max_pending=config.max_num_seqs + config.max_queue, metrics=metrics)
    app = FastAPI(title="compress", lifespan=_lifespan)
    app.state.serve = ServeState(engine, loop, RequestRunner(engine, loop), metrics, config)
    app.state.engine_loop, app.state.metrics = loop, metrics
    if config.api_key:
        app.add_middleware(BearerAuth, api_key=config.api_key)
    for exc, handler in HANDLERS.items():
        app.add_exception_handler(exc, handler)
    for router in ROUTERS:
        app.include_router(router)
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
