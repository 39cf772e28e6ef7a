"""The API key check: with a key every /v1 route needs ``Authorization: Bearer KEY``."""
from __future__ import annotations

import hmac

from fastapi.responses import JSONResponse

from runtime.serve.openai_protocol import APIError


class BearerAuth:
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
