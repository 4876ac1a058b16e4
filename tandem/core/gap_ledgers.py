"""What the ITL target's policy learns from the gaps its streams saw: the overrun ledger (how
many recent inter-token gaps ran over their step's target, for the p99's slack) and the noise
margin (how far below T to size steps with prompt work so that measured gaps, not predictions,
stay within it). Both count gaps over a window of the last ``OVERRUN_WINDOW`` (``GapWindow``);
``target_budget.PrefillShare`` reads them when it sizes a step, ``ChunkedPolicy`` records into them."""

from __future__ import annotations

from collections import deque


OVERRUN_WINDOW = 4096
"""Inter-token gaps the overrun ledger remembers."""


class GapWindow:
    """The last ``window`` inter-token gaps, step by step, and how many of them are marked (ran over
    the target, or were in a step with prompt work): each decode of a step is one gap."""

    def __init__(self, window: int = OVERRUN_WINDOW) -> None:
        self.window = window
        self.steps: deque[tuple[int, int]] = deque()  # (gaps, of them marked) per step
        self.gaps = 0
        self.marked = 0

    def add(self, gaps: int, marked: bool) -> None:
        m = gaps if marked else 0
        self.steps.append((gaps, m))
        self.gaps += gaps
        self.marked += m
        while self.gaps - self.steps[0][0] >= self.window:
            old, old_marked = self.steps.popleft()
            self.gaps -= old
            self.marked -= old_marked

    def mark(self, n: int) -> None:
        """Mark ``n`` gaps that are yet to be seen (each is counted among the gaps when its step is)."""
        self.steps.append((0, n))
        self.marked += n


class OverrunLedger:
    """The recent inter-token gaps and how many ran over their step's ITL target."""

    def __init__(self, share: float, window: int = OVERRUN_WINDOW) -> None:
        self.share = share
        self.recent = GapWindow(window)
        self.paused = GapWindow(window)
        """The same gaps, marked where a burst pause charged them (``charge``)."""

    @property
    def gaps(self) -> int:
        return self.recent.gaps

    @property
    def over(self) -> int:
        return self.recent.marked

    def record(self, decodes: int, seconds: float, target: float) -> None:
        """A measured step with ``decodes`` running streams and the ITL target it was sized to."""
        if decodes > 0:
            self.recent.add(decodes, seconds > target)
            self.paused.add(decodes, False)

    def allows(self, decodes: int) -> bool:
        """May a step with ``decodes`` running streams run over the target?"""
        return self.share > 0 and decodes > 0 and self.over + decodes <= self.share * (self.gaps + decodes)

    def allows_long_gaps(self, n: int, guaranteed: int) -> bool:
        """May ``n`` more streams each see one gap over the target, given ``guaranteed`` gaps that
        requests now running or waiting must still produce (their ``guaranteed_output_tokens``)?

        Only the long gaps that pauses charged count here, not the steps that ran over T by noise:
        those run a little over T, where the pauses' gaps are the longest of all, so while the
        pauses' stay within the share the p99 falls among the others, whatever their number;
        counted together, a slow spell of the host would forbid every pause."""
        return self.share > 0 and n > 0 and self.paused.marked + n <= self.share * (self.gaps + guaranteed)

    def charge(self, n: int) -> None:
        """``n`` streams will each see one gap over the target (a pause): counted as over now; the
        gaps themselves are counted when the steps that end them are recorded."""
        if n > 0:
            self.recent.mark(n)
            self.paused.mark(n)


MARGIN_WINDOW = 256
"""Steps with prompt work whose measured/predicted ratio the noise margin remembers."""
MARGIN_MIN_STEPS = 1
"""Below this many, the margin is 1 (the steps are sized to T itself). With few steps measured the
quantile is their largest ratio: the margin starts cautious and relaxes as steps accumulate."""


class NoiseMargin:
    """How far below T to size steps so that the measured gaps, not the predicted steps, stay
    within the target at p99.

    A step sized to T is predicted at T; measured, it runs longer about half the time (noise, and
    the time between steps that the streams' gaps include and a step's own time does not). Each
    step that carried decodes is recorded with its cycle (its start to the next step's start, the
    gap its streams saw) and its prediction. If a share f of the recent gaps were in steps with
    prompt work (the steps sized to the target) and a share ``slack`` of all gaps may run over T,
    those steps may run over on a share slack / f of them; the margin is 1 over the matching
    quantile of their measured/predicted ratio, at most 1."""

    def __init__(self, slack: float, window: int = MARGIN_WINDOW, gap_window: int = OVERRUN_WINDOW) -> None:
        self.slack = slack
        self.ratios: deque[float] = deque(maxlen=window)
        self.recent = GapWindow(gap_window)  # marked: gaps in steps with prompt work
        self.factor = 1.0

    @property
    def gaps(self) -> int:
        return self.recent.gaps

    @property
    def mixed_gaps(self) -> int:
        return self.recent.marked

    def record(self, decodes: int, mixed: bool, predicted: float, cycle: float) -> None:
        if decodes <= 0 or predicted <= 0 or cycle <= 0:
            return
        self.recent.add(decodes, mixed)
        if mixed:
            self.ratios.append(cycle / predicted)
            self._update()

    def _update(self) -> None:
        if self.slack <= 0 or len(self.ratios) < MARGIN_MIN_STEPS or not self.mixed_gaps:
            self.factor = 1.0
            return
        allowed = min(0.5, self.slack * self.gaps / self.mixed_gaps)  # share of those steps that may run over
        ordered = sorted(self.ratios)
        ratio = ordered[min(len(ordered) - 1, int((1.0 - allowed) * len(ordered)))]
        self.factor = min(1.0, 1.0 / ratio)
