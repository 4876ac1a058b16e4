"""Who goes first among waiting requests: plain arrival order, or fair sharing between users.

* ``fcfs`` — lower ``priority`` first, then earlier arrival (the queue's own order).
* ``vtc``  — the Virtual Token Counter of Sheng et al., "Fairness in Serving Large Language
             Models" (OSDI '24). Each user has a counter of the weighted service it received:
             ``prefill_weight`` per new prompt token computed plus ``decode_weight`` per output
             token sampled. Within one priority level the next request admitted is the earliest
             of the user whose counter is lowest. A user who arrives or returns (no request
             waiting or running) starts at ``max(own counter, the lowest counter of the active
             users)``, so time spent idle is not banked as credit.

The policies ask ``admission_order`` for the waiting queue and ``rank`` for running requests (the
order decodes are served in and, reversed, who is preempted first). FCFS ranks by (priority,
arrival). VTC ranks by (priority, the order each request was first admitted): fairness decided
who got in, and work admitted earlier is never preempted for work admitted later. Either key is
fixed for a request's whole life, so the request that ranks first always runs to completion
(the budget's no-livelock rule holds for both). Recomputing a preempted request's tokens is not
charged: preemption is the scheduler's choice, not service the user asked for.
"""

from __future__ import annotations

import itertools
from typing import Callable, Protocol

from tandem.core.registry import make
from tandem.core.request import Request

PRUNE_AT = 4096
"""Counters kept before idle users at the floor are forgotten (they would restart there anyway)."""


class FairnessSettings(Protocol):
    """What an ordering reads of the scheduler's configuration (``tandem.config.SchedulerConfig``)."""

    vtc_prefill_weight: float
    vtc_decode_weight: float


class Fairness(Protocol):
    name: str

    def on_arrival(self, request: Request) -> None: ...

    def on_finish(self, request: Request) -> None: ...

    def on_admit(self, request: Request) -> None: ...

    def charge(self, request: Request, prompt_tokens: int, sampled_tokens: int) -> None: ...

    def admission_order(self, waiting: list[Request]) -> list[Request]: ...

    def rank(self, request: Request) -> tuple[int, ...]: ...


class FCFS:
    name = "fcfs"

    def on_arrival(self, request: Request) -> None:
        pass

    def on_finish(self, request: Request) -> None:
        pass

    def on_admit(self, request: Request) -> None:
        pass

    def charge(self, request: Request, prompt_tokens: int, sampled_tokens: int) -> None:
        pass

    def admission_order(self, waiting: list[Request]) -> list[Request]:
        return list(waiting)  # the queue is kept in (priority, arrival) order

    def rank(self, request: Request) -> tuple[int, ...]:
        return request.sort_key()


class VTC:
    name = "vtc"

    def __init__(self, settings: FairnessSettings) -> None:
        self.prefill_weight = float(settings.vtc_prefill_weight)
        self.decode_weight = float(settings.vtc_decode_weight)
        self.counters: dict[str, float] = {}
        self._live: dict[str, int] = {}  # user -> requests waiting or running
        self._floor = 0.0  # the lowest active counter, remembered while nobody is active
        self._admissions = itertools.count()
        self._admitted: dict[str, int] = {}  # request id -> its first admission's index

    def on_arrival(self, request: Request) -> None:
        user = request.user
        if not self._live.get(user):
            self.counters[user] = max(self.counters.get(user, 0.0), self.floor())
        self._live[user] = self._live.get(user, 0) + 1

    def on_finish(self, request: Request) -> None:
        user = request.user
        self._admitted.pop(request.request_id, None)
        left = self._live.get(user, 0) - 1
        if left > 0:
            self._live[user] = left
            return
        self.floor()  # the last user to leave sets the floor its successors start from
        del self._live[user]
        if len(self.counters) > PRUNE_AT:
            self._prune()

    def on_admit(self, request: Request) -> None:
        self._admitted.setdefault(request.request_id, next(self._admissions))

    def charge(self, request: Request, prompt_tokens: int, sampled_tokens: int) -> None:
        cost = self.prefill_weight * prompt_tokens + self.decode_weight * sampled_tokens
        self.counters[request.user] = self.counters.get(request.user, 0.0) + cost

    def floor(self) -> float:
        """The lowest counter among users with requests waiting or running (never decreasing)."""
        if self._live:
            self._floor = max(self._floor, min(self.counters[u] for u in self._live))
        return self._floor

    def _prune(self) -> None:
        floor = self.floor()
        for user in [u for u, c in self.counters.items() if u not in self._live and c <= floor]:
            del self.counters[user]

    def admission_order(self, waiting: list[Request]) -> list[Request]:
        """Per priority level, repeatedly the earliest request of the user with the lowest
        counter, each pick charged ahead (its prompt at the prefill weight) so that one step's
        admissions are shared out as the counters would share them."""
        order: list[Request] = []
        level: list[Request] = []
        for request in waiting:  # already in (priority, arrival) order
            if level and request.priority != level[0].priority:
                order += self._fair(level)
                level = []
            level.append(request)
        return order + self._fair(level)

    def _fair(self, level: list[Request]) -> list[Request]:
        queues: dict[str, list[Request]] = {}
        for request in level:
            queues.setdefault(request.user, []).append(request)
        if len(queues) < 2:
            return level
        projected = {u: self.counters.get(u, 0.0) for u in queues}
        heads = {u: 0 for u in queues}
        order = []
        while queues:
            # lowest counter; a tie goes to the user whose next request arrived first
            user = min(queues, key=lambda u: (projected[u], queues[u][heads[u]].arrival_index))
            request = queues[user][heads[user]]
            order.append(request)
            projected[user] += self.prefill_weight * request.num_new_prompt_tokens
            heads[user] += 1
            if heads[user] == len(queues[user]):
                del queues[user]
        return order

    def rank(self, request: Request) -> tuple[int, ...]:
        return (request.priority, self._admitted.get(request.request_id, 1 << 62), request.arrival_index)


FAIRNESS_REGISTRY: dict[str, Callable[[FairnessSettings], Fairness]] = {
    "fcfs": lambda settings: FCFS(),
    "vtc": VTC,
}
"""Ordering name -> factory; the only list of orderings (``tandem.config`` and the CLI read it)."""


def make_fairness(name: str, settings: FairnessSettings) -> Fairness:
    return make(FAIRNESS_REGISTRY, "fairness", name, settings)
