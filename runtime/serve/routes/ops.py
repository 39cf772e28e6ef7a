"""Operations routes: /health, /metrics (Prometheus) and /v1/models."""
from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from runtime.serve.state import context_limit, served

router = APIRouter()


@router.get("/health")
async def health(request: Request):
    if not served(request).loop.alive:
        return JSONResponse({"status": "engine thread is not running"}, status_code=503)
    return {"status": "ok"}


@router.get("/metrics")
async def prometheus(request: Request):
    s = served(request)
    return PlainTextResponse(s.metrics.render(s.engine.stats()), media_type="text/plain; version=0.0.4")


@router.get("/v1/models")
async def models(request: Request):
    s = served(request)
    config, limit = s.config, context_limit(s.engine)
    cards = [{"id": name, "object": "model", "created": 0, "owned_by": "compress", "root": config.model_name,
              **({"max_model_len": limit} if limit is not None else {})}
             for name in (config.served_model_names or (config.model_name,))]
    return {"object": "list", "data": cards}
