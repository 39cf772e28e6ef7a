"""What the two generation endpoints share: a request's sampling params and grammar, and SSE streaming that
aborts the request however the stream ends.

Logprobs are those of the distribution each token was drawn from before truncation: the logits after
penalties, ``logit_bias`` and any grammar mask, at the request's temperature (1 when greedy); prompt
logprobs (completions ``echo`` with ``logprobs``) are the model's own, unprocessed.
"""
from __future__ import annotations

import json
from collections.abc import AsyncIterator

from fastapi.responses import StreamingResponse

from runtime.sequence import SamplingParams
from runtime.serve.openai_protocol import APIError
from runtime.serve.serving import RequestRunner


class AbortOnClose(StreamingResponse):
    """A streaming response that aborts its request however the stream ends (done, error, disconnect)."""

    def __init__(self, content, on_close):
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


async def sse(bodies: AsyncIterator[dict]) -> AsyncIterator[str]:
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
