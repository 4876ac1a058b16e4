"""The scheduler: queues, admission, preemption, and the step loop's bookkeeping.

``schedule()`` hands the configured policy a fresh ``StepBudget`` and turns what it planned into a
plain-data ``SchedulerOutput``; ``update()`` takes the runner's sampled tokens back, advances each
request's counters and finishes requests that hit a token-level stop. The policies differ only
in how they spend a step's budget (see ``policies.py``); admission, block reservation and
preemption live in the budget so that every policy obeys the same invariants.
"""

from __future__ import annotations

from typing import Callable

from tandem.config import SchedulerConfig
from tandem.core.budget import Planned, StepBudget
from tandem.core.fairness import make_fairness
from tandem.core.kv_blocks import BlockAllocator
from tandem.core.policies import make_policy
from tandem.core.prefix_cache import PrefixCache, PrefixHasher
from tandem.core.queues import RequestQueues
from tandem.core.request import FinishReason, Request, RequestStatus
from tandem.core.step import RunnerOutput, ScheduledChunk, SchedulerOutput

# Keep 1/WATERMARK_DIVISOR of the blocks free at admission (at least one), so that a fresh prefill does not
# force an immediate preemption on the next decode step.
WATERMARK_DIVISOR = 100


class RequestRejected(ValueError):
    """The request can never be served by this engine (it names the reason)."""


class Scheduler:
    def __init__(self, config: SchedulerConfig, allocator: BlockAllocator, clock: Callable[[], float],
                 cache_namespace: str = ""):
        """``cache_namespace``: what else the KV depends on (the model and its numerics), so that
        prefix blocks are named apart from any other engine's."""
        config.validate()
        self.config = config
        self.allocator = allocator
        self.clock = clock
        self.policy = make_policy(config.policy, config)
        self.fairness = make_fairness(config.fairness, config)
        self.queues = RequestQueues(self.fairness)
        self.requests: dict[str, Request] = {}
        self._arrivals = 0
        self._step_id = 0
        self._finished_since_step: list[str] = []
        self._in_flight: dict[str, Request] = {}  # the requests of the step being run
        self.watermark_blocks = max(1, allocator.num_blocks // WATERMARK_DIVISOR)
        self.num_preemptions = 0
        self.num_recomputed_tokens = 0
        self.last_cache_queries = self.last_cached_tokens = 0
        """Of the requests admitted in the last scheduled step: their tokens, and those they reused
        from the prefix cache (0 and 0 with the cache off)."""
        self.prefix_cache = (PrefixCache(allocator, PrefixHasher(allocator.block_size, cache_namespace))
                             if config.enable_prefix_caching else None)

    @property
    def waiting(self) -> list[Request]:
        return self.queues.waiting

    @property
    def running(self) -> list[Request]:
        return self.queues.running

    # --- requests in and out ---------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id: {request.request_id!r} is already in use")
        self.check_fits(request)
        request.arrival_index = self._arrivals
        self._arrivals += 1
        self.requests[request.request_id] = request
        self.queues.add(request)

    def check_fits(self, request: Request) -> None:
        """Reject, at admission, a request that could never fit in the whole KV cache."""
        needed = self.allocator.blocks_for(request.max_tokens_needed)
        if needed > self.allocator.num_blocks:
            raise RequestRejected(
                f"prompt: the request needs {request.max_tokens_needed} tokens of KV cache "
                f"({needed} blocks) but the cache holds only {self.allocator.num_blocks} blocks "
                f"of {self.allocator.block_size} tokens; shorten the prompt or max_tokens, or "
                "give the KV cache more memory"
            )

    def abort_request(self, request_id: str) -> Request | None:
        request = self.requests.get(request_id)
        if request is None or request.is_finished:
            return None
        self.finish(request, FinishReason.ABORT)
        return request

    def finish(self, request: Request, reason: FinishReason) -> None:
        if request.is_finished:
            return
        self.queues.remove(request)
        self.allocator.free(request.request_id)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.timing.finish = self.clock()
        del self.requests[request.request_id]
        self._finished_since_step.append(request.request_id)

    def has_unfinished(self) -> bool:
        return bool(self.queues)

    # --- one step ------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        self._step_id += 1
        budget = StepBudget(
            self.config.max_num_batched_tokens, self.config.max_num_seqs, self.allocator, self.queues,
            self.watermark_blocks, self.prefix_cache,
        )
        self.policy.schedule(self.queues, budget)
        budget.release_unadmitted()
        self.num_preemptions += len(budget.preempted)
        self.last_cache_queries = self.last_cached_tokens = 0
        for request in budget.admitted:
            self._count_reuse(request)
        for p in budget.planned:
            self._charge(p)
        now = self.clock()
        chunks = []
        self._in_flight = {}
        for p in budget.planned:
            request = p.request
            if request.timing.first_scheduled is None:
                request.timing.first_scheduled = now
            end = p.start + p.num_tokens
            samples = end == request.num_tokens
            chunks.append(ScheduledChunk(
                request_id=request.request_id,
                start=p.start,
                token_ids=tuple(request.token_slice(p.start, end)),
                block_table=tuple(self.allocator.block_table(request.request_id)),
                sampling=request.params,
                samples=samples,
                is_decode=p.num_tokens == 1 and samples and request.num_output_tokens > 0,
                num_prompt_tokens=request.num_prompt_tokens,
                num_recomputed_tokens=request.recomputed_in(p.start, end),
                prompt_token_ids=tuple(request.prompt_token_ids) if samples and not request.output_token_ids
                and request.params.repetition_penalty != 1 else None,
            ))
            self._in_flight[request.request_id] = request
        finished, self._finished_since_step = self._finished_since_step, []
        return SchedulerOutput(
            step_id=self._step_id,
            chunks=tuple(chunks),
            preempted_ids=tuple(r.request_id for r in budget.preempted),
            finished_ids=tuple(finished),
            sizing=self.policy.last_sizing,
        )

    def _count_reuse(self, request: Request) -> None:
        """An admitted request starts after what it reused of the prefix cache."""
        if self.prefix_cache is None:
            return
        reused = request.num_computed_tokens
        self.prefix_cache.count(request, reused)
        if request.timing.first_scheduled is None:
            request.num_cached_tokens = min(reused, request.num_prompt_tokens)
        self.last_cache_queries += request.num_tokens
        self.last_cached_tokens += reused

    def _charge(self, p: Planned) -> None:
        """Count a planned slice as service to its user: prompt tokens computed for the first
        time, and the token it samples; recomputation is the scheduler's cost, not the user's."""
        request, end = p.request, p.start + p.num_tokens
        self.fairness.charge(request, request.new_prompt_in(p.start, end), int(end == request.num_tokens))

    def update(self, output: SchedulerOutput, result: RunnerOutput) -> list[Request]:
        """Apply a finished step; returns the requests that received a token."""
        now = self.clock()
        touched: list[Request] = []
        for chunk in output.chunks:
            request = self._in_flight[chunk.request_id]
            if request.is_finished:  # aborted while the step ran
                continue
            request.num_computed_tokens = chunk.end
            if self.prefix_cache is not None:
                self.prefix_cache.publish(request, chunk.start, chunk.end)
            request.num_recomputed_tokens += chunk.num_recomputed_tokens
            self.num_recomputed_tokens += chunk.num_recomputed_tokens
            if not chunk.samples:
                continue
            sampled = result.sampled[request.request_id]
            request.output_token_ids.append(sampled.token_id)
            if sampled.logprob is not None:
                request.logprobs.append(sampled.logprob)
            if request.timing.first_token is None:
                request.timing.first_token = now
            request.timing.token_times.append(now)
            touched.append(request)
            reason = self._token_stop(request, sampled.token_id)
            if reason is not None:
                self.finish(request, reason)
        self._in_flight = {}
        return touched

    def _token_stop(self, request: Request, token_id: int) -> FinishReason | None:
        params = request.params
        if token_id in params.stop_token_ids:
            return FinishReason.STOP
        if not params.ignore_eos and token_id in request.eos_token_ids:
            return FinishReason.STOP
        if request.num_output_tokens >= params.max_tokens or request.num_tokens >= request.max_total_tokens:
            return FinishReason.LENGTH
        return None

    # --- invariants ------------------------------------------------------------------------
    def check_invariants(self) -> None:
        self.allocator.check_invariants()
        for request in self.waiting:
            if request.status is not RequestStatus.WAITING:
                raise AssertionError(f"request {request.request_id} in the waiting queue is {request.status.value}")
            if self.allocator.num_blocks_held(request.request_id):
                raise AssertionError(f"waiting request {request.request_id} holds blocks")
        for request in self.running:
            if request.status is not RequestStatus.RUNNING:
                raise AssertionError(f"request {request.request_id} in the running queue is {request.status.value}")
            if self.allocator.num_blocks_held(request.request_id) < self.allocator.blocks_for(
                request.num_computed_tokens
            ):
                raise AssertionError(f"running request {request.request_id} lacks blocks for its KV")
            if self.prefix_cache is not None:
                self.prefix_cache.check(request)
        if not self.queues and not self.allocator.all_free():
            raise AssertionError("the engine is idle but blocks are still held")
