"""The scheduler: queues, admission, preemption, and the step loop's bookkeeping.

``schedule()`` asks the configured policy which tokens the next step computes and returns a
``SchedulerOutput``; ``update()`` takes the runner's sampled tokens back, advances each
request's counters and finishes requests that hit a token-level stop. The policies differ only
in how they spend a step's budget (see ``policies.py``); admission, block reservation and
preemption are shared here so that every policy obeys the same invariants.
"""

from __future__ import annotations

import bisect
from typing import Callable

from tandem.config import SchedulerConfig
from tandem.core.kv_blocks import BlockAllocator
from tandem.core.request import FinishReason, Request, RequestStatus
from tandem.core.step import RunnerOutput, ScheduledChunk, SchedulerOutput


class RequestRejected(ValueError):
    """The request can never be served by this engine (it names the reason)."""


class Scheduler:
    def __init__(self, config: SchedulerConfig, allocator: BlockAllocator, clock: Callable[[], float]):
        from tandem.core.policies import make_policy

        config.validate()
        self.config = config
        self.allocator = allocator
        self.clock = clock
        self.policy = make_policy(config)
        self.waiting: list[Request] = []  # sorted by Request.sort_key
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._arrivals = 0
        self._step_id = 0
        self._finished_since_step: list[str] = []
        # Keep ~1% of blocks free at admission so that a fresh prefill does not force an
        # immediate preemption on the next decode step.
        self.watermark_blocks = max(1, allocator.num_blocks // 100)
        self.num_preemptions = 0

    # --- requests in and out ---------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id: {request.request_id!r} is already in use")
        self.check_fits(request)
        request.arrival_index = self._arrivals
        self._arrivals += 1
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self._enqueue_waiting(request)

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
        if request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        else:
            self.running.remove(request)
        self.allocator.free(request.request_id)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.timing.finish = self.clock()
        del self.requests[request.request_id]
        self._finished_since_step.append(request.request_id)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # --- one step ------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        self._step_id += 1
        builder = StepBuilder(self)
        self.policy.schedule(self, builder)
        now = self.clock()
        for chunk in builder.chunks:
            if chunk.request.timing.first_scheduled is None:
                chunk.request.timing.first_scheduled = now
        finished, self._finished_since_step = self._finished_since_step, []
        return SchedulerOutput(
            step_id=self._step_id,
            chunks=builder.chunks,
            preempted_ids=builder.preempted_ids,
            finished_ids=finished,
        )

    def update(self, output: SchedulerOutput, result: RunnerOutput) -> list[Request]:
        """Apply a finished step; returns the requests that received a token."""
        now = self.clock()
        touched: list[Request] = []
        for chunk in output.chunks:
            request = chunk.request
            if request.is_finished:  # aborted while the step ran
                continue
            request.num_computed_tokens = chunk.end
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
        return touched

    def fail_step(self, output: SchedulerOutput) -> list[Request]:
        """The step raised: finish its requests with an error; nothing else is touched."""
        failed = []
        for chunk in output.chunks:
            if not chunk.request.is_finished:
                self.finish(chunk.request, FinishReason.ERROR)
                failed.append(chunk.request)
        return failed

    # --- helpers shared by the policies ----------------------------------------------------
    def _token_stop(self, request: Request, token_id: int) -> FinishReason | None:
        params = request.params
        if token_id in params.stop_token_ids:
            return FinishReason.STOP
        if not params.ignore_eos and token_id in request.eos_token_ids:
            return FinishReason.STOP
        if request.num_output_tokens >= params.max_tokens or request.num_tokens >= request.max_total_tokens:
            return FinishReason.LENGTH
        return None

    def _enqueue_waiting(self, request: Request) -> None:
        keys = [r.sort_key() for r in self.waiting]
        self.waiting.insert(bisect.bisect_right(keys, request.sort_key()), request)

    def preempt(self, request: Request) -> None:
        """Free a running request's blocks; it recomputes its tokens when readmitted."""
        self.running.remove(request)
        self.allocator.free(request.request_id)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        request.timing.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue_waiting(request)

    def check_invariants(self) -> None:
        self.allocator.check_invariants()
        for request in self.waiting:
            if self.allocator.num_blocks_held(request.request_id):
                raise AssertionError(f"waiting request {request.request_id} holds blocks")
        for request in self.running:
            if self.allocator.num_blocks_held(request.request_id) < self.allocator.blocks_for(
                request.num_computed_tokens
            ):
                raise AssertionError(f"running request {request.request_id} lacks blocks for its KV")


class StepBuilder:
    """Spends one step's budget. The policies call ``schedule_running`` and ``admit``."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.s = scheduler
        self.tokens_left = scheduler.config.max_num_batched_tokens
        self.chunks: list[ScheduledChunk] = []
        self.preempted_ids: list[str] = []
        self._scheduled: set[str] = set()

    @property
    def num_seqs(self) -> int:
        return len(self.chunks)

    def is_scheduled(self, request: Request) -> bool:
        return request.request_id in self._scheduled

    def schedule_running(self, request: Request, num_tokens: int) -> bool:
        """Schedule ``num_tokens`` more of a running request, preempting lower-priority running
        requests that are not yet in this step if blocks run out. False if ``request`` itself
        had to be preempted."""
        s = self.s
        target = request.num_computed_tokens + num_tokens
        while not s.allocator.grow(request.request_id, target):
            victim = self._pick_victim(exclude=request)
            if victim is None:
                s.preempt(request)
                self.preempted_ids.append(request.request_id)
                return False
            s.preempt(victim)
            self.preempted_ids.append(victim.request_id)
        self._add(request, num_tokens)
        return True

    def admit(self, request: Request, num_tokens: int, reserve_tokens: int | None = None) -> bool:
        """Move a waiting request to running and schedule its first ``num_tokens``; never
        preempts. ``reserve_tokens`` reserves KV for that many tokens up front (static)."""
        s = self.s
        if len(s.running) >= s.config.max_num_seqs:
            return False
        target = max(request.num_computed_tokens + num_tokens, reserve_tokens or 0)
        missing = s.allocator.blocks_missing(request.request_id, target)
        if missing + s.watermark_blocks > s.allocator.num_free_blocks and s.running:
            return False
        if not s.allocator.grow(request.request_id, target):
            return False
        s.waiting.remove(request)
        s.running.append(request)
        request.status = RequestStatus.RUNNING
        self._add(request, num_tokens)
        return True

    def _add(self, request: Request, num_tokens: int) -> None:
        self.chunks.append(
            ScheduledChunk(
                request=request,
                start=request.num_computed_tokens,
                num_tokens=num_tokens,
                block_table=self.s.allocator.block_table(request.request_id),
            )
        )
        self._scheduled.add(request.request_id)
        self.tokens_left -= num_tokens

    def _pick_victim(self, exclude: Request) -> Request | None:
        # Only requests that rank below ``exclude`` may be preempted for it, so the request
        # that ranks first always makes progress (no livelock).
        candidates = [
            r
            for r in self.s.running
            if r.request_id not in self._scheduled and r.sort_key() > exclude.sort_key()
        ]
        return max(candidates, key=Request.sort_key, default=None)
