"""One step's budget: the token and seat limits, and the KV blocks the step may take.

The policies spend it: ``schedule_running`` (a running request's next tokens, preempting
lower-ranked requests when blocks run out) and ``admit`` (a waiting request's first tokens, which
never preempts). Each call answers whether it fit, so a policy is a loop over requests that
stops or skips on a refusal. The budget records what was scheduled; the scheduler turns that into
the step's plain-data output.

With prefix caching, a policy calls ``reuse_prefix`` on a waiting request before it sizes the
request's first chunk: the request takes its cached blocks and starts after them, so every sizing
rule sees where its prefill really begins. A request that is then not admitted gives them back at
the end of the step (``release_unadmitted``).
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.core.kv_blocks import BlockAllocator
from tandem.core.prefix_cache import PrefixCache
from tandem.core.queues import RequestQueues
from tandem.core.request import Request, RequestStatus


@dataclass
class Planned:
    """A request's slice of the step, as the budget granted it."""

    request: Request
    start: int
    num_tokens: int


class StepBudget:
    def __init__(
        self,
        max_tokens: int,
        max_seqs: int,
        allocator: BlockAllocator,
        queues: RequestQueues,
        watermark_blocks: int,
        prefix_cache: PrefixCache | None = None,
    ) -> None:
        self.tokens_left = max_tokens
        self.max_seqs = max_seqs
        self.allocator = allocator
        self.queues = queues
        self.watermark_blocks = watermark_blocks
        self.planned: list[Planned] = []
        self.preempted: list[Request] = []
        self.admitted: list[Request] = []
        self.prefix_cache = prefix_cache
        self._scheduled: set[str] = set()
        self._reusing: list[Request] = []

    @property
    def has_seat(self) -> bool:
        """Whether one more request may run (``max_num_seqs``)."""
        return len(self.queues.running) < self.max_seqs

    def is_scheduled(self, request: Request) -> bool:
        return request.request_id in self._scheduled

    def schedule_running(self, request: Request, num_tokens: int) -> bool:
        """Schedule ``num_tokens`` more of a running request, preempting lower-ranked running
        requests that are not yet in this step if blocks run out. False if ``request`` itself
        had to be preempted."""
        target = request.num_computed_tokens + num_tokens
        while not self.allocator.grow(request.request_id, target):
            victim = self._pick_victim(exclude=request)
            if victim is None:
                self._preempt(request)
                return False
            self._preempt(victim)
        self._plan(request, num_tokens)
        return True

    def admit(self, request: Request, num_tokens: int, reserve_tokens: int | None = None) -> bool:
        """Move a waiting request to running and schedule its first ``num_tokens``; never
        preempts. ``reserve_tokens`` reserves KV for that many tokens up front (static)."""
        if not self.has_seat:
            return False
        target = max(request.num_computed_tokens + num_tokens, reserve_tokens or 0)
        missing = self.allocator.blocks_missing(request.request_id, target)
        # Keep the watermark free while others run, so that a fresh prefill does not force a
        # preemption on the very next decode step.
        if missing + self.watermark_blocks > self.allocator.num_free_blocks and self.queues.running:
            return False
        if not self.allocator.grow(request.request_id, target):
            return False
        self.queues.start(request)
        self.admitted.append(request)
        self._plan(request, num_tokens)
        return True

    def reuse_prefix(self, request: Request) -> None:
        """Let a waiting request start after its cached prefix, if it has one."""
        if self.prefix_cache is None or request.num_computed_tokens or self.allocator.num_blocks_held(request.request_id):
            return
        blocks = self.prefix_cache.cached_prefix(request)
        if not blocks:
            return
        self.allocator.attach(request.request_id, blocks)
        request.num_computed_tokens = len(blocks) * self.allocator.block_size
        self._reusing.append(request)

    def release_unadmitted(self) -> None:
        """Waiting requests hold nothing between steps: return the prefixes of those not admitted."""
        for request in self._reusing:
            if request.status is RequestStatus.WAITING:
                self.allocator.free(request.request_id)
                request.num_computed_tokens = 0
        self._reusing = []

    def _plan(self, request: Request, num_tokens: int) -> None:
        self.planned.append(Planned(request, request.num_computed_tokens, num_tokens))
        self._scheduled.add(request.request_id)
        self.tokens_left -= num_tokens

    def _preempt(self, request: Request) -> None:
        """Free a running request's blocks; it recomputes its tokens when readmitted."""
        self.allocator.free(request.request_id)
        request.num_cached_ever = max(request.num_cached_ever, request.num_computed_tokens)
        request.num_computed_tokens = 0
        request.timing.num_preemptions += 1
        self.queues.requeue(request)
        self.preempted.append(request)

    def _pick_victim(self, exclude: Request) -> Request | None:
        # Only requests that rank below ``exclude`` may be preempted for it, so the request
        # that ranks first always makes progress (no livelock). The rank comes from the
        # fairness ordering and is fixed for a request's life (see tandem.core.fairness).
        rank = self.queues.rank_key
        candidates = [
            r
            for r in self.queues.running
            if r.request_id not in self._scheduled and rank(r) > rank(exclude)
        ]
        return max(candidates, key=rank, default=None)
