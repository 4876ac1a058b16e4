"""The scheduler's two queues: waiting requests in rank order, and running ones.

Every move between them goes through here, so a request's status always matches the queue that
holds it. The scheduler owns the queues; a step's budget moves requests (admission,
preemption) through these methods and nothing else edits the lists. The queues also tell the
fairness ordering (``tandem.core.fairness``) of every arrival, admission and departure, and
ask it the order in which policies should consider requests.
"""

from __future__ import annotations

import bisect

from tandem.core.fairness import FCFS, Fairness
from tandem.core.request import Request, RequestStatus


class RequestQueues:
    def __init__(self, fairness: Fairness | None = None) -> None:
        self.waiting: list[Request] = []  # sorted by Request.sort_key
        self.running: list[Request] = []
        self.fairness: Fairness = fairness if fairness is not None else FCFS()

    def add(self, request: Request) -> None:
        """A new request arrives."""
        self.fairness.on_arrival(request)
        self.enqueue(request)

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
        self.fairness.on_admit(request)

    def requeue(self, request: Request) -> None:
        """Running -> waiting (preemption)."""
        self.running.remove(request)
        self.enqueue(request)

    def remove(self, request: Request) -> None:
        """Take a request out of whichever queue holds it (it finished)."""
        (self.waiting if request.status is RequestStatus.WAITING else self.running).remove(request)
        self.fairness.on_finish(request)

    def admission_order(self) -> list[Request]:
        """The waiting requests in the order a policy should try to admit them."""
        return self.fairness.admission_order(self.waiting)

    def rank_key(self, request: Request) -> tuple[int, ...]:
        """A running request's rank: lower is served first and preempted last."""
        return self.fairness.rank(request)

    def ranked_running(self) -> list[Request]:
        return sorted(self.running, key=self.rank_key)

    def __bool__(self) -> bool:
        return bool(self.waiting or self.running)
