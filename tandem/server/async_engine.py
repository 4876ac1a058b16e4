"""The engine loop in its own thread, with an asyncio face for the HTTP handlers.

Handlers never touch the engine: they validate and tokenize (``Engine.make_request`` changes no
state), then hand the request to the loop through a lock-protected inbox. The loop thread adds
and aborts requests between steps, runs ``step()``, and pushes each output to the request's
asyncio queue with ``call_soon_threadsafe`` as soon as the step ends. A slow client only slows
its own queue's consumer; the loop never waits for a socket.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from tandem.core.engine import Engine
from tandem.core.outputs import RequestOutput
from tandem.core.request import Request

log = logging.getLogger(__name__)


class QueueFull(Exception):
    """The waiting queue is at its bound; the client should retry later."""


@dataclass
class _Stream:
    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop


class AsyncEngine:
    def __init__(
        self,
        engine: Engine,
        max_waiting: int,
        on_finish: Callable[[RequestOutput], None] | None = None,
    ) -> None:
        self.engine = engine
        self.max_waiting = max_waiting
        self._on_finish = on_finish
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._inbox: deque[Request] = deque()
        self._aborts: deque[str] = deque()
        self._streams: dict[str, _Stream] = {}
        self._stop = False
        self.errors = 0
        self.last_error: str | None = None
        self.last_error_time: float | None = None
        self._thread = threading.Thread(target=self._run, name="tandem-engine", daemon=True)

    # --- lifecycle -------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._wake:
            self._stop = True
            self._wake.notify()
        self._thread.join(timeout=30)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # --- called from the event loop ----------------------------------------------------------------
    def num_waiting(self) -> int:
        return self.engine.num_waiting + len(self._inbox)

    def submit(self, request: Request) -> asyncio.Queue:
        """Queue a validated request; raises QueueFull when the waiting queue is at its bound."""
        stream = _Stream(asyncio.Queue(), asyncio.get_running_loop())
        with self._wake:
            if self.engine.num_waiting + len(self._inbox) >= self.max_waiting:
                raise QueueFull(f"{self.max_waiting} requests are already waiting")
            self._streams[request.request_id] = stream
            self._inbox.append(request)
            self._wake.notify()
        return stream.queue

    def abort(self, request_id: str) -> None:
        with self._wake:
            if request_id in self._streams:
                self._aborts.append(request_id)
                self._wake.notify()

    async def outputs(self, request: Request) -> AsyncIterator[RequestOutput]:
        """Submit and yield outputs until the request finishes; aborts it if the caller stops."""
        queue = self.submit(request)
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request.request_id)

    # --- the loop thread ------------------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        while True:
            with self._wake:
                while not self._stop and not self._inbox and not self._aborts and not engine.has_unfinished_requests():
                    self._wake.wait()
                if self._stop:
                    break
                inbox, self._inbox = list(self._inbox), deque()
                aborts, self._aborts = list(self._aborts), deque()
            for request in inbox:
                try:
                    engine.add(request)
                except Exception as exc:  # e.g. a duplicate id: only this request fails
                    self._push(request.request_id, exc)
                    self._close(request.request_id)
            for request_id in aborts:  # after the adds: an abort may follow its add closely
                out = engine.abort_request(request_id)
                if out is not None and self._on_finish is not None:
                    self._on_finish(out)
                self._close(request_id)
            if not engine.has_unfinished_requests():
                continue
            try:
                outputs = engine.step()
            except Exception as exc:  # a bug outside the forward pass: keep the loop alive
                log.exception("engine step failed")
                self._fault(f"{type(exc).__name__}: {exc}")
                continue
            if engine.step_fault is not None:  # a request's own failure (isolated) is no fault of the server's
                self._fault(engine.step_fault)
            for out in outputs:
                self._push(out.request_id, out)
                if out.finished:
                    if self._on_finish is not None:
                        self._on_finish(out)
                    self._close(out.request_id)
        # shutting down: whoever still waits gets an error instead of hanging
        for request_id in list(self._streams):
            self._push(request_id, RuntimeError("the server is shutting down"))
            self._close(request_id)

    def _fault(self, message: str) -> None:
        self.errors += 1
        self.last_error = message
        self.last_error_time = time.time()

    def _push(self, request_id: str, item) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)

    def _close(self, request_id: str) -> None:
        with self._lock:
            self._streams.pop(request_id, None)
