"""The three scheduling policies. Each is a loop that spends one step's budget.

* ``static``        — when nothing runs, form a batch (KV reserved for each member's whole
                      output) and prefill it; then decode it to completion. Nobody joins.
* ``prefill-first`` — continuous batching: if the head of the queue fits, the step prefills
                      waiting prompts whole (running streams pause); otherwise it decodes.
* ``chunked``       — one token budget per step: running decodes first, then chunks of
                      partially prefilled and waiting prompts fill what is left.

For ``prefill-first`` the budget limits how many prompts share a prefill step; a single prompt
longer than the budget still runs, alone, in one step. ``static`` prefills its whole batch (bounded
by ``max_num_seqs`` and the KV cache) in one step, as one padded ``generate()`` call would.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Protocol

from tandem.config import SchedulerConfig
from tandem.core.request import Request, RequestStatus

if TYPE_CHECKING:
    from tandem.core.scheduler import Scheduler, StepBuilder


class Policy(Protocol):
    name: str

    def schedule(self, s: "Scheduler", b: "StepBuilder") -> None: ...


def _by_rank(requests: list[Request]) -> list[Request]:
    return sorted(requests, key=Request.sort_key)


def _decode_running(s: "Scheduler", b: "StepBuilder") -> None:
    for request in _by_rank(s.running):
        if request.status is not RequestStatus.RUNNING:  # preempted earlier in this loop
            continue
        if b.tokens_left <= 0:
            break
        b.schedule_running(request, min(request.num_uncomputed_tokens, b.tokens_left))


def _admit_whole_prompts(s: "Scheduler", b: "StepBuilder", reserve_output: bool, token_budget: bool) -> None:
    for request in list(s.waiting):
        n = request.num_uncomputed_tokens
        if token_budget and b.chunks and n > b.tokens_left:
            break
        reserve = request.max_tokens_needed if reserve_output else None
        if not b.admit(request, n, reserve_tokens=reserve):
            break


class StaticPolicy:
    name = "static"

    def schedule(self, s: "Scheduler", b: "StepBuilder") -> None:
        if s.running:
            _decode_running(s, b)
        else:
            # One padded batch, as a plain generate() call forms it: seats and KV bound it,
            # not the per-step token budget.
            _admit_whole_prompts(s, b, reserve_output=True, token_budget=False)


class PrefillFirstPolicy:
    name = "prefill-first"

    def schedule(self, s: "Scheduler", b: "StepBuilder") -> None:
        _admit_whole_prompts(s, b, reserve_output=False, token_budget=True)
        if not b.chunks:
            _decode_running(s, b)


class ChunkedPolicy:
    name = "chunked"

    def __init__(self, config: SchedulerConfig) -> None:
        self.threshold = config.long_prefill_token_threshold
        self.max_long = config.max_long_partial_prefills

    def _is_long(self, request: Request) -> bool:
        return self.threshold > 0 and request.num_tokens > self.threshold

    def _chunk(self, request: Request, tokens_left: int) -> int:
        n = min(request.num_uncomputed_tokens, tokens_left)
        return min(n, self.threshold) if self._is_long(request) else n

    def schedule(self, s: "Scheduler", b: "StepBuilder") -> None:
        ranked = _by_rank(s.running)
        # 1. Decodes first: a running stream never waits for somebody else's prompt.
        for request in ranked:
            if b.tokens_left <= 0:
                break
            if request.status is RequestStatus.RUNNING and not request.is_prefilling:
                b.schedule_running(request, 1)
        # 2. Prompts already part-way through their prefill.
        for request in ranked:
            if b.tokens_left <= 0:
                break
            if request.status is RequestStatus.RUNNING and not b.is_scheduled(request):
                b.schedule_running(request, self._chunk(request, b.tokens_left))
        # 3. New prompts, in rank order; long ones wait while the long-prefill cap is reached.
        long_active = sum(1 for r in s.running if r.is_prefilling and self._is_long(r))
        for request in list(s.waiting):
            if b.tokens_left <= 0 or len(s.running) >= s.config.max_num_seqs:
                break
            is_long = self._is_long(request)
            if is_long and self.max_long and long_active >= self.max_long:
                continue
            if not b.admit(request, self._chunk(request, b.tokens_left)):
                break
            long_active += is_long


POLICY_REGISTRY: dict[str, Callable[[SchedulerConfig], Policy]] = {
    "static": lambda config: StaticPolicy(),
    "prefill-first": lambda config: PrefillFirstPolicy(),
    "chunked": ChunkedPolicy,
}


def make_policy(config: SchedulerConfig) -> Policy:
    try:
        return POLICY_REGISTRY[config.policy](config)
    except KeyError:
        raise ValueError(f"policy: unknown policy {config.policy!r}") from None
