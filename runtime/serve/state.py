"""What every route reads, kept on ``app.state.serve``: the engine, its loop and request runner, the metrics and
the server's settings; and the checks every request body passes first."""
from __future__ import annotations

from dataclasses import dataclass

from fastapi import Request

from runtime.serve.config import ServerConfig
from runtime.serve.engine_loop import EngineLoop
from runtime.serve.metrics import ServerMetrics
from runtime.serve.openai_protocol import APIError
from runtime.serve.serving import RequestRunner
from runtime.serve.tool_calls import ToolFormat, format_for


@dataclass(frozen=True)
class ServeState:
    """One app's engine and the serving machinery around it."""

    engine: object
    loop: EngineLoop
    runner: RequestRunner
    metrics: ServerMetrics
    config: ServerConfig

    @property
    def model(self) -> str:
        """The model name responses carry."""
        return self.config.names[0]

    @property
    def tool_format(self) -> ToolFormat:
        return format_for(self.config.tool_call_parser, getattr(self.engine, "tokenizer", None))

    def check(self, req) -> None:
        """400 for a field this server does not implement, 404 for a model it does not serve."""
        unknown = req.unknown_fields()
        if unknown:
            raise APIError(400, f"request field(s) {', '.join(unknown)} not supported by this server; remove them "
                           "(a dropped field would change the answer without telling you)", param=unknown[0])
        names = self.config.names
        if req.model and req.model not in names:
            raise APIError(404, f"model {req.model!r} is not served here; use one of {list(dict.fromkeys(names))}",
                           param="model", type="not_found_error")


def served(request: Request) -> ServeState:
    """The state of the app ``request`` came to."""
    return request.app.state.serve


def context_limit(engine) -> int | None:
    """The engine's max_model_len, wherever this engine version keeps it."""
    for holder in (engine, getattr(engine, "config", None)):
        value = getattr(holder, "max_model_len", None)
        if isinstance(value, int):
            return value
    return None
