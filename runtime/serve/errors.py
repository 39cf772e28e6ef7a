"""Errors as OpenAI error bodies: an APIError as raised, a body FastAPI could not validate as 400 or 422."""
from __future__ import annotations

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from runtime.serve.openai_protocol import APIError
from runtime.serve.state import served


async def api_error(request: Request, exc: APIError) -> JSONResponse:
    if exc.status == 429:
        served(request).metrics.rejected.inc(reason="queue_full")
    return JSONResponse(exc.body(), status_code=exc.status)


async def invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
    """400 when the body is not a JSON object at all, else 422 naming every bad field."""
    errors = exc.errors()
    whole_body = [e for e in errors if e.get("type") == "json_invalid" or (
        tuple(e.get("loc", ())) == ("body",) and e.get("type") in ("model_attributes_type", "dict_type", "missing"))]
    if whole_body:  # not JSON, or JSON that is not an object: the body itself is malformed
        msg = f"request body must be a JSON object ({whole_body[0].get('msg')})"
        return JSONResponse(APIError(400, msg, param="body").body(), status_code=400)
    fields = [".".join(str(p) for p in e.get("loc", ()) if p != "body") or "body" for e in errors]
    message = "; ".join(f"{f}: {e.get('msg')}" for f, e in zip(fields, errors))
    return JSONResponse(APIError(422, message, param=fields[0] if fields else None).body(), status_code=422)


HANDLERS = {APIError: api_error, RequestValidationError: invalid_request}
