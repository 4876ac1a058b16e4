"""First come, first served admission ahead of the engine's waiting queue.

The rule (docs/server.md): requests enter the waiting queue strictly in the order they arrived.
One that finds room and nobody queued ahead of it goes straight in; otherwise it queues here for
up to ``timeout`` seconds, and whenever room appears the queue's head goes in first. A request is
refused (429) only when the queue already holds ``capacity`` requests as it arrives, or when it
has waited ``timeout`` seconds. Neither depends on who sent it or how often it was refused
before, so a client that retries stands in line exactly like a newcomer arriving at that moment,
and nobody who arrives after it overtakes it. Before this queue, a freed slot went to whichever
request happened to arrive first after it, and clients retrying on a fixed period could miss
every slot.

``Retry-After`` is the time the requests ahead (and this one) take to go in at the rate requests
went in over the last ``RATE_WINDOW_S`` seconds, from 1 to ``MAX_RETRY_AFTER_S``.

Everything here runs on the event loop; the engine thread only schedules ``poke``.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

RATE_WINDOW_S = 30.0
MAX_RETRY_AFTER_S = 60


class QueueFull(Exception):
    """No room now: the client should retry after ``retry_after`` seconds."""

    def __init__(self, message: str, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = retry_after


@dataclass(eq=False)
class _Waiter:
    n: int
    enter: Callable[[], Any]
    future: asyncio.Future
    timer: asyncio.TimerHandle | None = field(default=None)


class AdmissionQueue:
    def __init__(self, room: Callable[[], int], capacity: int, timeout: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._room = room  # how many more requests the waiting queue takes now
        self.capacity = capacity
        self.timeout = timeout
        self._clock = clock
        self._queue: deque[_Waiter] = deque()
        self._admitted: deque[tuple[float, int]] = deque()  # (time, requests) of recent admissions
        self._closed: BaseException | None = None
        self.loop: asyncio.AbstractEventLoop | None = None

    def __len__(self) -> int:
        return len(self._queue)

    async def admit(self, n: int, enter: Callable[[], Any], leave: Callable[[Any], None]) -> Any:
        """Wait for room for ``n`` requests in arrival order, then return ``enter()`` (which puts
        them in the waiting queue). Raises QueueFull, or the exception given to ``close``.
        ``leave(result)`` undoes ``enter`` if the caller is cancelled after it ran."""
        if self._closed is not None:
            raise self._closed
        if not self._queue and self._room() >= n:
            return self._enter(n, enter)
        if len(self._queue) >= self.capacity or self.timeout <= 0:
            raise QueueFull(f"the waiting queue and the admission queue ({self.capacity}) are full",
                            self.retry_after(n))
        self.loop = asyncio.get_running_loop()
        waiter = _Waiter(n, enter, self.loop.create_future())
        waiter.timer = self.loop.call_later(self.timeout, self._expire, waiter)
        self._queue.append(waiter)
        try:
            return await waiter.future
        except asyncio.CancelledError:
            if self._drop(waiter):
                self.poke()
            fut = waiter.future
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                leave(fut.result())  # admitted just before the caller went away
            raise

    def poke(self) -> None:
        """Room may have appeared: let in as many as fit, from the head."""
        while self._queue:
            head = self._queue[0]
            if head.future.done():  # its caller was cancelled and has not run yet
                self._queue.popleft()
                continue
            if self._room() < head.n:
                return
            self._queue.popleft()
            head.timer.cancel()
            try:
                head.future.set_result(self._enter(head.n, head.enter))
            except Exception as exc:  # noqa: BLE001 - the error belongs to that request
                head.future.set_exception(exc)

    def close(self, exc: BaseException) -> None:
        """Refuse everything from now on; whoever waits gets ``exc``."""
        self._closed = exc
        while self._queue:
            waiter = self._queue.popleft()
            waiter.timer.cancel()
            if not waiter.future.done():
                waiter.future.set_exception(exc)

    def retry_after(self, n: int) -> int:
        now = self._clock()
        while self._admitted and self._admitted[0][0] < now - RATE_WINDOW_S:
            self._admitted.popleft()
        if not self._admitted:
            return 1
        rate = sum(k for _, k in self._admitted) / max(now - self._admitted[0][0], 1.0)
        ahead = sum(w.n for w in self._queue) + n
        return max(1, min(MAX_RETRY_AFTER_S, math.ceil(ahead / rate)))

    def _enter(self, n: int, enter: Callable[[], Any]) -> Any:
        result = enter()
        self._admitted.append((self._clock(), n))
        return result

    def _expire(self, waiter: _Waiter) -> None:
        if self._drop(waiter) and not waiter.future.done():
            waiter.future.set_exception(QueueFull(
                f"no room in the waiting queue within the admission timeout of {self.timeout:g} s",
                self.retry_after(waiter.n)))
        self.poke()  # a head that needed more room than there was no longer blocks the others

    def _drop(self, waiter: _Waiter) -> bool:
        if waiter.timer is not None:
            waiter.timer.cancel()
        try:
            self._queue.remove(waiter)
        except ValueError:
            return False
        return True
