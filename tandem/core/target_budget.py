"""The prefill share of a step under latency targets (what the chunked policy may prefill).

The rule, for one step, after the running decodes are planned:

* **ITL.** While any decode runs, the step's target T is the tightest ``target_itl_ms`` among
  the decoding requests (a request's own, else the engine's; with neither, ``itl_target_factor``
  times the decode step of a full batch, ``max_num_seqs`` streams at the running ones' mean
  context, as the start-up estimate (which timed such a batch) prices it, at least
  ``min_target_itl_ms``). Prefill chunks are granted, in
  rank order, the most tokens that keep the step-time model's prediction of the whole step
  within T. Whatever the prediction says, the step gets one KV block (``block_size`` tokens) of
  prefill, so prompts never starve; where the runner multiplies a long prompt's chunk in whole
  tiles of rows (w8a8's bf16 road on AMX: 128), that minimum is one tile, which costs no more
  than one block does there. With no decode running, or no target, the share is the
  whole token budget (``max_num_batched_tokens``).
* **Noise margin.** With ``itl_margin_share`` s > 0 (0.005 by default), steps with prompt work
  are sized to T times a margin, so that measured gaps, not only predictions, stay within T at
  p99: if a share f of the recent gaps were in such steps, the margin is 1 over the (1 - s/f)
  quantile of their measured cycle / predicted time (``NoiseMargin``), at most 1; with few of
  them measured that quantile is their largest ratio.
* **Overrun allowance.** With ``itl_overrun_share`` q > 0, the policy keeps a ledger of the
  recent inter-token gaps (each decode of a measured step is one gap; over the target when the
  step took longer than its T). While the gaps over T, plus this step's decodes, stay within q of
  all of them, a step with prompt work takes the whole token budget instead of the ITL share.
  A p99 target lets one gap in 100 run over; q = 0.005 spends half of that on finishing prompts
  in fewer, larger steps, and steps that ran over by misprediction use up the same allowance.
  With no gaps recorded yet there is no allowance: it is earned by steps within T, and only the
  last ``OVERRUN_WINDOW`` gaps count, so idle time banks nothing.
* **Burst pause.** Before any of this, a step may pause the running streams instead, prefilling
  a burst of waiting prompts with the whole token budget (``burst_pause.BurstPause``), one long
  gap per stream paid for from the same ledger.
* **TTFT.** A prompt with a ``target_ttft_ms`` (its own, else the engine's) whose predicted
  first token, at the ITL share, lands after its deadline (arrival + target) may take more: the
  smallest chunk per step that meets the deadline. It does so only if that is possible within
  this step's token budget; a prompt that would miss its deadline anyway keeps the ITL share,
  so a lost cause does not stall every stream too. So TTFT wins over ITL for prompts that can
  still make it, and ITL wins otherwise.

The predicted time to a first token counts the steps left to prefill the prompt at a given
chunk size (each carrying the current decodes), not the prompts queued ahead of it.
"""

from __future__ import annotations

import math
from typing import Protocol, Sequence

from tandem.core.budget import Planned
from tandem.core.request import Request
from tandem.core.sampling_params import SamplingParams
from tandem.core.step import StepSizing
from tandem.core.step_time import Features, StepTimeModel, add, chunk_features, features


class TargetSettings(Protocol):
    """What the share reads of ``tandem.config.SchedulerConfig``."""

    target_itl_ms: float | None
    target_ttft_ms: float | None
    itl_target_factor: float
    itl_overrun_share: float
    itl_margin_share: float
    min_target_itl_ms: float
    max_num_seqs: int


class TargetLimits(Protocol):
    min_target_itl_ms: float
    min_target_ttft_ms: float


def check_request_targets(params: SamplingParams, limits: TargetLimits) -> None:
    """A request may not ask for a tighter target than the engine allows (ValueError naming the field)."""
    for name in ("target_itl_ms", "target_ttft_ms"):
        value, least = getattr(params, name), getattr(limits, "min_" + name)
        if value is not None and value < least:
            raise ValueError(f"{name}: must be at least {least:g} ms on this server, got {value!r}")


def _seconds(ms: float | None) -> float | None:
    return ms / 1000.0 if ms else None


def itl_target(decodes: Sequence[Request], default_ms: float | None) -> float | None:
    """Seconds: the tightest ITL target among the decoding requests (None: no target)."""
    targets = [t for t in (_seconds(r.params.target_itl_ms) or _seconds(default_ms) for r in decodes) if t]
    return min(targets, default=None)


def full_batch(planned: Sequence[Planned], max_num_seqs: int) -> Features:
    """The features of a decode step of ``max_num_seqs`` streams (at least the planned ones) at the
    planned decodes' mean context."""
    n = max(len(planned), max_num_seqs)
    start = round(sum(p.start for p in planned) / len(planned))
    return features([(start, 1)] * n)


def step_target(model: StepTimeModel, planned: Sequence[Planned], settings: TargetSettings) -> float | None:
    """Seconds: the ITL target T of a step whose decodes are ``planned`` (None: no target)."""
    if not planned:
        return None
    target = itl_target([p.request for p in planned], settings.target_itl_ms)
    if target is None and settings.itl_target_factor:
        # no explicit target: a multiple of what a full batch of decodes takes, so it scales with
        # the CPU instead of being one number for every machine, and does not tighten while only
        # a few streams run (when a long step delays few gaps and prompts are waiting). Priced by
        # the start-up estimate, which timed a full batch, not by the online fit: that fit sees
        # the steps a load runs (a few decodes beside prompt chunks at first, never a full batch
        # at C < max_num_seqs), so its extrapolation of a full batch, and with it T, moves from
        # step to step; nor does T grow when the host slows (the margin, from measured gaps,
        # keeps steps within it then)
        full = model.prior.predict(full_batch(planned, settings.max_num_seqs))
        target = max(settings.itl_target_factor * full, settings.min_target_itl_ms / 1000.0)
    return target


class PrefillShare:
    """One step's prefill allowance: ``size`` a chunk, then ``take`` it once it is scheduled."""

    def __init__(self, model: StepTimeModel, planned: Sequence[Planned], settings: TargetSettings,
                 min_tokens: int, now: float, margin: float = 1.0) -> None:
        self.model = model
        self.margin = margin
        """The share of T that steps with prompt work are sized to (``NoiseMargin.factor``)."""
        self.now = now
        self.ttft_default_ms = settings.target_ttft_ms
        self.num_decodes = len(planned)
        self.decode_x = features((p.start, p.num_tokens) for p in planned)
        self.x = self.decode_x  # the step as planned so far
        self.target = step_target(model, planned, settings)
        self.min_tokens = min_tokens
        """Prompt tokens a step carries whatever the prediction says: one KV block, or the
        runner's prompt tile where a chunk costs whole tiles (``ChunkedPolicy.use_step_model``)."""
        self.granted = 0
        self.ttft_tokens = 0
        """Of ``granted``, the tokens beyond the ITL share that TTFT deadlines took."""
        self._ttft_pending = 0  # of the chunk ``size`` last returned, until it is taken
        self.asked = False
        """A prompt asked for tokens in this step (else there was no prompt work to size)."""

    @property
    def limited(self) -> bool:
        return self.target is not None and not self.overrun

    overrun = False
    """Set when the overrun allowance lets this step take the whole token budget."""

    def predicted(self) -> float:
        return self.model.predict(self.x)

    def size(self, request: Request, want: int) -> int:
        """Tokens of ``request``'s next chunk, at most ``want`` (its token-budget chunk)."""
        self.asked = self.asked or want > 0
        if want <= 0 or not self.limited:
            return max(want, 0)
        start = request.num_computed_tokens
        n = max(self._fits(start, want), min(want, self.min_tokens - self.granted))
        chunk = max(n, self._ttft_chunk(request, start, n, want))
        self._ttft_pending = chunk - n
        return chunk

    def take(self, start: int, n: int) -> None:
        self.x = add(self.x, chunk_features(start, n))
        self.granted += n
        self.ttft_tokens += self._ttft_pending
        self._ttft_pending = 0

    def sizing(self) -> StepSizing | None:
        """What sized this step's prompt work, for its ``StepStats`` (None: no target applied)."""
        if self.target is None:
            return None
        return StepSizing(self.target, self.margin, self.overrun, self.ttft_tokens, prompts=self.asked)

    def _fits(self, start: int, want: int) -> int:
        """The largest chunk at ``start`` that keeps the predicted step within the target (less the margin)."""
        limit = self.target * self.margin
        if self.model.predict(add(self.x, chunk_features(start, 1))) > limit:
            return 0  # the common case once the step is full: no search
        lo, hi = 1, want
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.model.predict(add(self.x, chunk_features(start, mid))) <= limit:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _ttft_chunk(self, request: Request, start: int, itl_n: int, want: int) -> int:
        """The smallest chunk per step that meets the request's TTFT deadline, if it can; else 0."""
        target = _seconds(request.params.target_ttft_ms) or _seconds(self.ttft_default_ms)
        if target is None or request.num_output_tokens:  # a recompute already had its first token
            return 0
        left = request.arrival_time + target - self.now
        remaining = request.num_uncomputed_tokens
        if itl_n and self._time_to_first_token(start, remaining, itl_n) <= left:
            return 0
        if self._time_to_first_token(start, remaining, want) > left:
            return 0  # cannot make it within the budget: ITL wins
        lo, hi = max(itl_n, 1), want
        while lo < hi:  # fewer, larger steps finish sooner: the time falls as the chunk grows
            mid = (lo + hi) // 2
            if self._time_to_first_token(start, remaining, mid) <= left:
                hi = mid
            else:
                lo = mid + 1
        return lo

    def _time_to_first_token(self, start: int, remaining: int, n: int) -> float:
        """Predicted seconds of the steps that prefill ``remaining`` tokens from ``start`` in chunks of
        ``n``, each step also carrying the current decodes (whose contexts grow a token per step)."""
        m = math.ceil(remaining / n)
        d = self.num_decodes
        base, tokens, seqs, context, pairs, _ = self.decode_x
        grow = d * m * (m - 1) / 2  # decode keys added over the m steps
        total = (
            base * m,
            tokens * m + remaining,
            seqs * m + m,
            context * m + grow + (m - 1) * start + n * (m - 1) * m / 2 + start + remaining,
            pairs * m + grow + remaining * start + remaining * (remaining + 1) / 2,
            float(m) if n > 1 else 0.0,  # each of the m steps is a prompt step
        )
        return self.model.predict(total)
