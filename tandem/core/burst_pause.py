"""Burst pause: running streams wait while a burst of prompts prefills, one long gap each.

A p99 ITL target lets one gap in 100 run long, and ``itl_overrun_share`` of them is the chunked
policy's to spend (``gap_ledgers.OverrunLedger``). Spread over many steps, a burst of prompts
sized to the target costs every stream many slightly longer gaps and the prompts many steps;
prefilled whole while the streams wait, it costs each waiting stream one long gap. So when at
least as many prompts wait (and can take a seat) as streams run, and the ledger can pay one gap
over the target for every stream, the step pauses the streams and gives its whole token budget
to prompts, and so do the steps after it while prompts remain, each paying for the streams that
joined (a prompt finished in the pause is a stream that waits too).

The ledger counts the recent gaps and, for a pause, also the gaps that the requests running or
waiting must still produce (``Request.guaranteed_gaps_left``: with ``ignore_eos`` all of
``max_tokens``, else ``min_tokens``): a burst at a load's start has earned nothing yet, but
streams that will each run 127 more gaps can pay 0.9% of those. Streams whose length is unknown
promise nothing, so their pauses are paid for by gaps already seen.

No stream waits for prompts of a lower priority (``priority``). A pause ends when no prompt work
is left to do, when the ledger cannot pay for the streams that
joined, or at the first step that starts ``max_pause_ms`` after it began; then the streams decode
at least one step before another pause may start.
"""

from __future__ import annotations

from typing import Sequence

from tandem.core.gap_ledgers import OverrunLedger
from tandem.core.queues import RequestQueues
from tandem.core.request import Request


END_REASONS = {
    "done": "no prompt work left to do",
    "ledger": "the overrun ledger could not pay one long gap for each stream that joined",
    "time": "max_pause_ms since it began",
    "priority": "a running stream outranks the waiting prompts",
    "gate": "no prompt fits: a step of every stream's decode and one block would exceed T",
    "kv": "no prompt could be scheduled (KV blocks, seats or the long-prompt cap)",
    "off": "the pause was switched off (no overrun share, no max_pause_ms, no target)",
}
"""Why a burst pause ends: the ``pause_end`` of ``StepSizing``, the trace and ``/metrics``."""


class BurstPause:
    def __init__(self, ledger: OverrunLedger, max_seconds: float) -> None:
        self.ledger = ledger
        self.max_seconds = max_seconds
        self.paused: set[str] = set()
        """The streams of the current pause that its ledger charge has paid for."""
        self.since: float | None = None
        """When the current pause began (None: no pause)."""
        self._resumed = False  # a pause just ended: the next step decodes
        self.ended = ""
        """Why the last pause ended (one of ``END_REASONS``), until ``take_ended`` reads it; "" none."""

    def wanted(self, queues: RequestQueues, streams: Sequence[Request], seats: int, now: float) -> list[Request] | None:
        """Whether this step should pause ``streams`` (the running requests it would decode): the ones
        it must still pay for, or None for no pause. ``seats``: how many more requests may run."""
        if self._resumed or self.max_seconds <= 0 or not self.ledger.share or not streams:
            self._resumed = False
            return self.end("off")
        prefilling = sum(r.is_prefilling for r in queues.running)
        burst = prefilling + min(len(queues.waiting), max(seats, 0))
        if not burst:
            return self.end("done")
        new = [r for r in streams if r.request_id not in self.paused]
        if self.since is None and burst < len(new):
            return None  # fewer prompts than the streams it would stall
        if queues.waiting and min(r.priority for r in streams) < min(r.priority for r in queues.waiting):
            return self.end("priority")  # a stream of a higher priority does not wait for lower ones' prompts
        if self.since is not None and now - self.since >= self.max_seconds:
            return self.end("time")
        if new:
            guaranteed = sum(r.guaranteed_gaps_left for r in (*queues.running, *queues.waiting))
            if not self.ledger.allows_long_gaps(len(new), guaranteed):
                return self.end("ledger")
        return new

    def commit(self, new: Sequence[Request], now: float) -> None:
        """The step paused: charge the ledger one long gap for each stream that joined."""
        self.ledger.charge(len(new))
        self.paused.update(r.request_id for r in new)
        if self.since is None:
            self.since = now

    def end(self, reason: str = "done") -> None:
        """No pause (now): the streams decode this step; ``reason`` (``END_REASONS``) is why, if a
        pause was running."""
        if self.since is not None:
            self._resumed = True
            self.ended = reason
        self.paused.clear()
        self.since = None
        return None

    def take_ended(self) -> str:
        """Why a pause ended since the last call ("" if none did), once."""
        reason, self.ended = self.ended, ""
        return reason
