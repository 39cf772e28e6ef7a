"""Drives an Engine from one background thread and hands each request's outputs to asyncio.

The engine is synchronous (``step()`` runs one scheduled batch). One thread loops ``step()`` while
work exists and, for every output, schedules delivery into that request's ``asyncio.Queue`` on the
server's event loop with ``loop.call_soon_threadsafe``; the event loop is never blocked by the model.
``submit``/``abort`` are called from the event loop thread (the engine allows that while ``step()``
runs elsewhere). Timings for the metrics are taken here, in the engine thread, when outputs exist.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass

from runtime.serve.metrics import RequestTiming, ServerMetrics

log = logging.getLogger(__name__)


class QueueFull(Exception):
    """More requests are pending than the server admits (running batch plus waiting queue)."""


@dataclass
class _Pending:
    queue: asyncio.Queue
    arrival: float  # time.time() at submit
    first_token: float | None = None
    completion_tokens: int = 0
    prompt_tokens: int = 0


class EngineLoop:
    """One background thread stepping the engine; per-request asyncio queues for the results."""

    def __init__(self, engine, max_pending: int, metrics: ServerMetrics | None = None):
        if max_pending < 1:
            raise ValueError(f"max_pending={max_pending} must be >= 1")
        self.engine, self.max_pending = engine, max_pending
        self.metrics = metrics or ServerMetrics()
        self._pending: dict[str, _Pending] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._error: BaseException | None = None

    # --- lifecycle --------------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        assert self._thread is None, "already started"
        self._loop = loop
        self._thread = threading.Thread(target=self._run, name="engine-step", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        self._thread = None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    # --- called on the event loop -----------------------------------------------------------------
    def submit(self, prompt: str | list[int], params, request_id: str | list[str],
               queue: asyncio.Queue | None = None) -> asyncio.Queue:
        """Queue a request (or, with lists of params and ids, choices of one prompt sharing its KV); their
        outputs (``StepOutput``s, or an exception) arrive on the returned queue (``queue`` when given)."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        plist = params if isinstance(params, list) else [params]
        if len(self._pending) + len(ids) > self.max_pending:
            raise QueueFull(f"{len(self._pending)} requests are pending (limit {self.max_pending}); retry later")
        queue = queue if queue is not None else asyncio.Queue()
        now = time.time()
        self._pending.update((rid, _Pending(queue, now)) for rid in ids)
        try:
            self.engine.add_choices(prompt, plist, ids)
        except BaseException:
            for rid in ids:
                del self._pending[rid]
            raise
        self._wake.set()
        return queue

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its KV blocks; False if it had already finished."""
        if self._pending.pop(request_id, None) is None:
            return False
        self.engine.abort(request_id)
        self.metrics.requests.inc(finish_reason="abort")
        self._wake.set()
        return True

    def _deliver(self, outputs: list, now: float) -> None:
        for out in outputs:
            p = self._pending.get(out.request_id)
            if p is None:  # aborted while the step ran
                continue
            if out.new_token_ids and p.first_token is None:
                p.first_token = now
            p.prompt_tokens = out.prompt_tokens
            p.completion_tokens = out.completion_tokens
            p.queue.put_nowait(out)
            if out.finished:
                del self._pending[out.request_id]
                self.metrics.record_finished(RequestTiming(p.arrival, p.first_token, now, out.prompt_tokens,
                                                           out.completion_tokens, out.finish_reason or "stop"))

    def _fail_all(self, error: BaseException) -> None:
        for rid in list(self._pending):
            p = self._pending.pop(rid)
            p.queue.put_nowait(error)
            try:
                self.engine.abort(rid)
            except Exception:  # the engine is already broken; the client still gets the first error
                log.exception("abort of %s after an engine failure also failed", rid)

    # --- the engine thread ------------------------------------------------------------------------
    def _run(self) -> None:
        assert self._loop is not None
        while not self._stop.is_set():
            if not self.engine.has_unfinished():
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception as e:
                log.exception("engine.step() failed; failing every pending request")
                self._error = e
                self._loop.call_soon_threadsafe(self._fail_all, e)
                time.sleep(0.1)  # let the aborts land before stepping again
                continue
            if outputs:
                try:
                    self._loop.call_soon_threadsafe(self._deliver, outputs, time.time())
                except RuntimeError:  # the event loop closed under us: the server is shutting down
                    return
