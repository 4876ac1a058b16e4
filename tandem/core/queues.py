"""The scheduler's two queues: waiting requests in rank order, and running ones.

Every move between them goes through here, so a request's status always matches the queue that
holds it. The scheduler owns the queues; a step's budget moves requests (admission,
preemption) through these methods and nothing else edits the lists.
"""

from __future__ import annotations

import bisect

from tandem.core.request import Request, RequestStatus


class RequestQueues:
    def __init__(self) -> None:
        self.waiting: list[Request] = []  # sorted by Request.sort_key
        self.running: list[Request] = []

    def enqueue(self, request: Request) -> None:
        """Put a new or preempted request in the waiting queue, in rank order."""
        keys = [r.sort_key() for r in self.waiting]
        self.waiting.insert(bisect.bisect_right(keys, request.sort_key()), request)
        request.status = RequestStatus.WAITING

    def start(self, request: Request) -> None:
        """Waiting -> running."""
        self.waiting.remove(request)
        self.running.append(request)
        request.status = RequestStatus.RUNNING

    def requeue(self, request: Request) -> None:
        """Running -> waiting (preemption)."""
        self.running.remove(request)
        self.enqueue(request)

    def remove(self, request: Request) -> None:
        """Take a request out of whichever queue holds it (it finished)."""
        (self.waiting if request.status is RequestStatus.WAITING else self.running).remove(request)

    def ranked_running(self) -> list[Request]:
        return sorted(self.running, key=Request.sort_key)

    def __bool__(self) -> bool:
        return bool(self.waiting or self.running)
