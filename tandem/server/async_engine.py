"""The engine loop beside the HTTP event loop, with an asyncio face for the HTTP handlers.

``tandem serve`` runs the loop on the process's main thread (``run``) and uvicorn in a thread of
its own: torch's OpenMP runtime keeps one worker pool per thread that starts parallel work, and
once the main thread (which loaded the model) and an engine thread both hold a pool, libgomp
counts more threads than cores and makes its workers sleep instead of spin between operators —
every parallel operator then pays a futex wake-up, and decode steps were a third slower. In-process
users (tests, ``ThreadedServer``) call ``start``, which runs the same loop in a thread.

Handlers never touch the engine: they validate and tokenize (``Engine.make_request`` changes no
state), then hand the request to the loop through a lock-protected inbox. The loop thread adds
and aborts requests between steps, runs ``step()``, and pushes the step's outputs to the
requests' asyncio queues, one ``call_soon_threadsafe`` per event loop, as soon as the step ends.
A slow client only slows its own queue's consumer; the loop never waits for a socket.

Requests reach the inbox through the first-come admission queue (``admission.py``); on shutdown
``begin_shutdown`` refuses new work and ``end_all`` finishes every open request with
``ShuttingDown``, which the routes turn into a final error event.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

from tandem.core.engine import Engine
from tandem.core.outputs import RequestOutput
from tandem.core.request import Request
from tandem.server.admission import AdmissionQueue, QueueFull

log = logging.getLogger(__name__)

IDLE_WAKE_S = 0.25
"""How often the idle loop wakes, so that a SIGINT or SIGTERM is handled (serve runs it on the main
thread) however the kernel routed it."""

__all__ = ["AsyncEngine", "NeverFits", "QueueFull", "ShuttingDown"]


class ShuttingDown(Exception):
    """The server is shutting down: the request is refused, or ended before it finished."""


class NeverFits(ValueError):
    """More requests at once than the waiting queue ever holds: retrying cannot help."""


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
        admission_queue: int = 0,
        admission_timeout: float = 0.0,
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
        self._end_all = False
        self._closing: ShuttingDown | None = None
        self.admission = AdmissionQueue(lambda: self.max_waiting - self.num_waiting(), admission_queue,
                                        admission_timeout)
        self._poke_pending = False
        self.errors = 0
        self.last_error: str | None = None
        self.last_error_time: float | None = None
        self._thread = threading.Thread(target=self.run, name="tandem-engine", daemon=True)
        self._caller_runs = False
        self._running = False

    # --- lifecycle -------------------------------------------------------------------------------
    def run_on_caller(self) -> None:
        """The caller will run the loop itself (``run``, on the main thread); ``start`` then
        starts nothing."""
        self._caller_runs = True

    def start(self) -> None:
        if not self._caller_runs:
            self._thread.start()

    def stop(self) -> None:
        with self._wake:
            self._stop = True
            self._wake.notify()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=30)

    @property
    def alive(self) -> bool:
        return self._running or self._thread.is_alive()

    # --- called from the event loop ----------------------------------------------------------------
    def num_waiting(self) -> int:
        return self.engine.num_waiting + len(self._inbox)

    async def submit_all(self, requests: list[Request]) -> list[asyncio.Queue]:
        """Queue all of the requests or none, first come first served (see admission.py); raises
        QueueFull (with its Retry-After), NeverFits or ShuttingDown."""
        if self._closing is not None:
            raise self._closing
        if len(requests) > self.max_waiting:
            raise NeverFits(f"{len(requests)} sequences never fit a waiting queue of {self.max_waiting}")
        return await self.admission.admit(len(requests), lambda: self._enqueue(requests),
                                          lambda _: [self.abort(r.request_id) for r in requests])

    def _enqueue(self, requests: list[Request]) -> list[asyncio.Queue]:
        loop = asyncio.get_running_loop()
        streams = [_Stream(asyncio.Queue(), loop) for _ in requests]
        with self._wake:
            for request, stream in zip(requests, streams):
                self._streams[request.request_id] = stream
                self._inbox.append(request)
            self._wake.notify()
        return [s.queue for s in streams]

    def begin_shutdown(self) -> None:
        """Refuse new requests from now on (those waiting for admission too); running ones go on."""
        self._closing = ShuttingDown("the server is shutting down")
        self.admission.close(self._closing)

    def end_all(self) -> None:
        """Abort every open request; each gets ShuttingDown as its last item."""
        with self._wake:
            self._end_all = True
            self._wake.notify()

    @property
    def num_open(self) -> int:
        """Requests accepted and not yet finished."""
        return len(self._streams)

    def abort(self, request_id: str) -> None:
        with self._wake:
            if request_id in self._streams:
                self._aborts.append(request_id)
                self._wake.notify()

    # --- the loop ------------------------------------------------------------------------------------
    def run(self) -> None:
        """The engine loop, until ``stop``. Should the loop itself fail (a bug outside a step, which
        a step's own errors never are), every open request gets ShuttingDown, newcomers are
        refused, and the error is raised: nothing waits for an engine that is gone."""
        self._running = True
        try:
            self._loop()
        except BaseException as exc:
            log.exception("the engine loop failed")
            self._abandon(ShuttingDown(f"the engine stopped: {type(exc).__name__}: {exc}"))
            raise
        finally:
            self._running = False

    def _abandon(self, exc: ShuttingDown) -> None:
        """Refuse newcomers and end every open stream with ``exc``, touching nothing of the engine."""
        self._closing = exc
        loop = self.admission.loop
        if loop is not None:
            try:
                loop.call_soon_threadsafe(self.admission.close, exc)
            except RuntimeError:  # the event loop has closed
                pass
        with self._lock:
            open_ids = list(self._streams)
            self._inbox.clear()
        for request_id in open_ids:
            try:
                self._push(request_id, exc)
            except RuntimeError:  # that stream's event loop has closed
                pass
            self._close(request_id)

    def _loop(self) -> None:
        engine = self.engine
        while True:
            with self._wake:
                while (not self._stop and not self._end_all and not self._inbox and not self._aborts
                       and not engine.has_unfinished_requests()):
                    # timed: Python runs a signal's handler on the main thread only once that thread
                    # wakes, and the kernel may deliver the signal to any other thread of the process
                    self._wake.wait(IDLE_WAKE_S)
                if self._stop:
                    break
                inbox, self._inbox = list(self._inbox), deque()
                aborts, self._aborts = list(self._aborts), deque()
                end_all, self._end_all = self._end_all, False
            if end_all:
                self._finish_all(inbox)
                continue
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
            self._poke_admission()
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
            finished = [out for out in outputs if out.finished]
            if self._on_finish is not None:
                for out in finished:
                    self._on_finish(out)
            self._push_step(outputs)
            for out in finished:
                self._close(out.request_id)
            self._poke_admission()
        # stopped: whoever still waits gets an error instead of hanging
        self._finish_all([])

    def _finish_all(self, inbox: list[Request]) -> None:
        for request in inbox:  # never added: nothing to free
            self._push(request.request_id, ShuttingDown("the server is shutting down"))
            self._close(request.request_id)
        for request_id in list(self._streams):
            out = self.engine.abort_request(request_id)
            if out is not None and self._on_finish is not None:
                self._on_finish(out)
            self._push(request_id, ShuttingDown("the server shut down before this request finished"))
            self._close(request_id)

    def _poke_admission(self) -> None:
        """Room may have appeared in the waiting queue: let the admission queue's head in."""
        loop = self.admission.loop
        if len(self.admission) and loop is not None and not self._poke_pending:
            self._poke_pending = True
            try:
                loop.call_soon_threadsafe(self._run_poke)
            except RuntimeError:  # the event loop has closed
                self._poke_pending = False

    def _run_poke(self) -> None:
        self._poke_pending = False
        self.admission.poke()

    def _fault(self, message: str) -> None:
        self.errors += 1
        self.last_error = message
        self.last_error_time = time.time()

    def _push(self, request_id: str, item) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)

    def _push_step(self, outputs: list[RequestOutput]) -> None:
        """A step's outputs, handed to each event loop in one call: one wake-up of the HTTP
        thread per step, not one per stream (each wake-up is a write to the loop's self-pipe, and
        the woken thread then contends for the GIL while this thread pushes the rest)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput]]] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                by_loop.setdefault(stream.loop, []).append((stream.queue, out))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_deliver, items)

    def _close(self, request_id: str) -> None:
        with self._lock:
            self._streams.pop(request_id, None)


def _deliver(items: list[tuple[asyncio.Queue, object]]) -> None:
    for queue, item in items:
        queue.put_nowait(item)
