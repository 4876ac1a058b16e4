"""The three scheduling policies. Each is a loop that spends one step's budget.

* ``static``        — when nothing runs, form a batch (KV reserved for each member's whole
                      output) and prefill it; then decode it to completion. Nobody joins.
* ``prefill-first`` — continuous batching: if the head of the queue fits, the step prefills
                      waiting prompts whole (running streams pause); otherwise it decodes.
* ``chunked``       — one token budget per step: running decodes first, then chunks of
                      partially prefilled and waiting prompts fill what is left; with latency
                      targets the prefill share is sized by ``target_budget.PrefillShare``.

For ``prefill-first`` the budget limits how many prompts share a prefill step; a single prompt
longer than the budget still runs, alone, in one step. ``static`` prefills its whole batch (bounded
by ``max_num_seqs`` and the KV cache) in one step, as one padded ``generate()`` call would.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, NamedTuple, Protocol

from tandem.core.budget import Planned, StepBudget
from tandem.core.burst_pause import BurstPause
from tandem.core.queues import RequestQueues
from tandem.core.registry import make
from tandem.core.request import Request, RequestStatus
from tandem.core.step import StepSizing
from tandem.core.step_time import StepCost, StepTimeModel, add, chunk_features, features
from tandem.core.gap_ledgers import NoiseMargin, OverrunLedger
from tandem.core.target_budget import PrefillShare, step_target


class PolicySettings(Protocol):
    """What a policy reads of the scheduler's configuration (``tandem.config.SchedulerConfig``)."""

    long_prefill_token_threshold: int
    max_long_partial_prefills: int
    target_itl_ms: float | None
    target_ttft_ms: float | None
    itl_target_factor: float
    itl_overrun_share: float
    itl_margin_share: float
    min_target_itl_ms: float
    max_pause_ms: float
    max_num_seqs: int


class Policy(Protocol):
    name: str
    last_sizing: StepSizing | None
    """How the last ``schedule`` sized its prompt work under an ITL target (None: no target)."""

    def schedule(self, queues: RequestQueues, budget: StepBudget) -> None: ...


def _decode_running(queues: RequestQueues, budget: StepBudget) -> None:
    for request in queues.ranked_running():
        if request.status is not RequestStatus.RUNNING:  # preempted earlier in this loop
            continue
        if budget.tokens_left <= 0:
            break
        budget.schedule_running(request, min(request.num_uncomputed_tokens, budget.tokens_left))


def _admit_whole_prompts(queues: RequestQueues, budget: StepBudget, reserve_output: bool, token_budget: bool) -> None:
    for request in queues.admission_order():
        if not budget.has_seat:  # checked first: taking a cached prefix only to give it back is waste
            break
        budget.reuse_prefix(request)
        n = request.num_uncomputed_tokens
        if token_budget and budget.planned and n > budget.tokens_left:
            break
        reserve = request.max_tokens_needed if reserve_output else None
        if not budget.admit(request, n, reserve_tokens=reserve):
            break


class StaticPolicy:
    name = "static"
    last_sizing = None

    def schedule(self, queues: RequestQueues, budget: StepBudget) -> None:
        if queues.running:
            _decode_running(queues, budget)
        else:
            # One padded batch, as a plain generate() call forms it: seats and KV bound it,
            # not the per-step token budget.
            _admit_whole_prompts(queues, budget, reserve_output=True, token_budget=False)


class PrefillFirstPolicy:
    name = "prefill-first"
    last_sizing = None

    def schedule(self, queues: RequestQueues, budget: StepBudget) -> None:
        _admit_whole_prompts(queues, budget, reserve_output=False, token_budget=True)
        if not budget.planned:
            _decode_running(queues, budget)


class ChunkedPolicy:
    name = "chunked"

    def __init__(self, settings: PolicySettings) -> None:
        self.settings = settings
        self.threshold = settings.long_prefill_token_threshold
        self.max_long = settings.max_long_partial_prefills
        # The engine replaces these with its fitted model and its clock (``use_step_model``).
        self.step_model = StepTimeModel(StepCost())
        self.clock: Callable[[], float] = time.monotonic
        self.prompt_tile = 1
        self.ledger = OverrunLedger(settings.itl_overrun_share)
        self.margin = NoiseMargin(settings.itl_margin_share)
        self.pause = BurstPause(self.ledger, settings.max_pause_ms / 1000.0)
        self._last: _Sized | None = None
        """The last step that carried decodes under an ITL target, settled when the next is planned."""
        self.last_sizing: StepSizing | None = None

    def use_step_model(self, model: StepTimeModel, clock: Callable[[], float], prompt_tile: int = 1) -> None:
        """The engine's fitted model, its clock, and the rows its runner multiplies a long prompt's
        chunk in (``ModelRunner.prompt_tile``): a step made to carry prompt work carries at least that."""
        self.step_model = model
        self.clock = clock
        self.prompt_tile = max(1, prompt_tile)

    def _is_long(self, request: Request) -> bool:
        return self.threshold > 0 and request.num_tokens > self.threshold

    def _chunk(self, request: Request, tokens_left: int) -> int:
        n = min(request.num_uncomputed_tokens, tokens_left)
        return min(n, self.threshold) if self._is_long(request) else n

    def schedule(self, queues: RequestQueues, budget: StepBudget) -> None:
        ranked = queues.ranked_running()
        now = self.clock()
        self._settle(now)
        streams = [r for r in ranked if r.status is RequestStatus.RUNNING and not r.is_prefilling]
        if self._pause_streams(queues, ranked, streams, budget, now):
            return
        # 1. Decodes first: a running stream never waits for somebody else's prompt (but in a pause).
        for request in streams:
            if budget.tokens_left <= 0:
                break
            if request.status is RequestStatus.RUNNING:  # not preempted by an earlier one's growth
                budget.schedule_running(request, 1)
        share = PrefillShare(self.step_model, budget.planned, self.settings,
                             max(budget.allocator.block_size, self.prompt_tile), now, self.margin.factor)
        decodes = [p.request for p in budget.planned] if share.target is not None else []
        self._spend_overrun(queues, share)
        self._schedule_prompts(queues, ranked, budget, share)
        sizing, ended = share.sizing(), self.pause.take_ended()
        self.last_sizing = dataclasses.replace(sizing, pause_end=ended) if sizing is not None and ended else sizing
        if decodes and (self.margin.slack or self.ledger.share):
            self._last = _Sized(now, decodes, share.target, self.step_model.last, share.granted > 0,
                                share.predicted())

    def _schedule_prompts(self, queues: RequestQueues, ranked: list[Request], budget: StepBudget,
                          share: PrefillShare, may_start: Callable[[Request], bool] | None = None) -> None:
        # 2. Prompts already part-way through their prefill.
        for request in ranked:
            if budget.tokens_left <= 0:
                break
            if request.status is RequestStatus.RUNNING and not budget.is_scheduled(request) and request.is_prefilling:
                start, n = request.num_computed_tokens, share.size(request, self._chunk(request, budget.tokens_left))
                if n and budget.schedule_running(request, n):
                    share.take(start, n)
        # 3. New prompts, in rank order; long ones wait while the long-prefill cap is reached.
        long_active = sum(1 for r in queues.running if r.is_prefilling and self._is_long(r))
        for request in queues.admission_order():
            if budget.tokens_left <= 0 or not budget.has_seat:
                break
            is_long = self._is_long(request)
            if is_long and self.max_long and long_active >= self.max_long:
                continue
            if may_start is not None and not may_start(request):
                break
            budget.reuse_prefix(request)
            start, n = request.num_computed_tokens, share.size(request, self._chunk(request, budget.tokens_left))
            if not n:  # no time left for it; a later prompt may still need its TTFT share
                continue
            if not budget.admit(request, n):
                break
            share.take(start, n)
            long_active += is_long

    def _pause_streams(self, queues: RequestQueues, ranked: list[Request], streams: list[Request],
                       budget: StepBudget, now: float) -> bool:
        """A burst pause (``burst_pause``): if this step pauses the streams, schedule it (prompts only,
        the whole token budget) and say so."""
        if not streams:
            self.pause.end()
            return False
        new = self.pause.wanted(queues, streams, budget.max_seqs - len(queues.running), now)
        if new is None:
            return False
        # priced only where a pause is wanted: most steps stop at the cheap checks above
        target = step_target(self.step_model, [Planned(r, r.num_computed_tokens, 1) for r in streams], self.settings)
        if target is None:
            self.pause.end("off")
            return False
        # a prompt starts only if, once prefilled, a step of every stream's decode and the least
        # prompt chunk a step carries still fits in T
        contexts = [(r.num_computed_tokens, 1) for r in streams]
        contexts += [(r.num_tokens, 1) for r in queues.running if r.is_prefilling]
        limit = target * self.margin.factor
        least = chunk_features(0, max(budget.allocator.block_size, self.prompt_tile))

        gated = False

        def may_start(request: Request) -> bool:
            nonlocal gated
            if self.step_model.predict(add(features([*contexts, (request.num_tokens, 1)]), least)) > limit:
                gated = True
                return False
            contexts.append((request.num_tokens, 1))
            return True

        self._schedule_prompts(queues, ranked, budget, PrefillShare(self.step_model, (), self.settings, 0, now),
                               may_start)
        if not budget.planned:  # no prompt could be scheduled: decode instead
            self.pause.end("gate" if gated else "kv")
            return False
        self.pause.commit(new, now)
        self.last_sizing = StepSizing(target, self.margin.factor, paused=len(streams))
        return True

    def _settle(self, now: float) -> None:
        """Record the last step under a target: in the noise margin with its cycle (its start to
        now, the gap its streams saw) if its streams are still running (after an idle spell the
        cycle is no gap anybody saw); in the overrun ledger, once the engine has measured it, with
        that cycle, or with its measured time where its streams have ended."""
        last, self._last = self._last, None
        if last is None:
            return
        streaming = any(r.status is RequestStatus.RUNNING for r in last.decodes)
        cycle = now - last.start
        if self.margin.slack and streaming:
            self.margin.record(len(last.decodes), last.mixed, last.predicted, cycle)
        measured = self.step_model.last
        if self.ledger.share and measured is not None and measured is not last.observed:
            # the gap the streams saw (the cycle) where they still run; else the step's own time
            self.ledger.record(len(last.decodes), cycle if streaming else measured.seconds, last.target)

    def _spend_overrun(self, queues: RequestQueues, share: PrefillShare) -> None:
        """Let this step take the whole token budget if the overrun allowance has room and prompts are
        waiting to be computed."""
        if share.target is None or not self.ledger.share:
            return
        prompts = queues.waiting or any(r.is_prefilling for r in queues.running)
        if prompts and self.ledger.allows(share.num_decodes):
            share.overrun = True


class _Sized(NamedTuple):
    """A step planned under an ITL target, as its settling needs it."""

    start: float
    decodes: list[Request]
    target: float
    observed: object
    """The step-time model's last observation when it was planned (the step before it)."""
    mixed: bool
    """It carried prompt work."""
    predicted: float


POLICY_REGISTRY: dict[str, Callable[[PolicySettings], Policy]] = {
    "static": lambda settings: StaticPolicy(),
    "prefill-first": lambda settings: PrefillFirstPolicy(),
    "chunked": ChunkedPolicy,
}
"""Policy name -> factory; the only list of policies (``tandem.config`` and the CLI read it)."""


def make_policy(name: str, settings: PolicySettings) -> Policy:
    return make(POLICY_REGISTRY, "policy", name, settings)
