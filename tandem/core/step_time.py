"""The step-time model: seconds of one step from the shape of its chunks, fitted online.

``seconds = base + per_token * tokens + per_seq * max(knee, sequences) + per_context * (KV positions
read) + per_pair * (attention (query, key) pairs) + per_prompt_step * (1 if a chunk has more than one
token)``: fixed weight reads, compute per token, sampling and bookkeeping per sequence, attention's
memory reads per visible key, prefill attention's compute per pair, and what a step with prompt
work pays once for leaving the decode-only path (the fused decode layers, one attention group,
matmuls sized for a few rows), which a per-token cost alone reads as a steep price for the first
prompt tokens of a step: beside 16 decodes of 24 ms, 2 prompt tokens added 14 ms and 16 added
20 ms on an Intel Xeon (model 207, w8a8; ``benchmarks/prompt_step_cost.py``). ``knee``
(sequences, 0 by default: a plain sum) is where a step stops costing a
weight-read floor: a kernel that multiplies each weight tile by every row of a batch while the next
tile streams in costs the same for 1 to ``knee`` rows, then each row more costs its products
(measured: w8a8 decode on an AVX2 Zen 3 timed 20, 24 and 87 ms for 1, 4 and 16 rows). ``features`` is the one definition of those quantities; the simulator's
``StepCost`` (``tandem.sim``) is this module's coefficients, so a simulated step costs exactly
what a fitted model of it would predict.

``StepTimeModel`` starts from a prior (a start-up estimate) and refits, every ``refit_every``
measured steps, a least-squares fit of the relative error over the last ``window`` steps,
ridge-regularized toward the prior scaled to the window's speed (``speed_factor``: how much
longer than the prior's prediction its steps ran) and constrained to non-negative coefficients.
Features are scaled by their RMS over the window, so ``prior_weight`` reads as "the prior is worth
this many steps", and a feature the window never shows (no prefill seen yet) keeps its scaled prior
coefficient.

A window rarely shows every kind of step (a burst's: full decode batches and whole prompt
steps), and the ridge alone then splits a prompt step's cost where its penalty is least. So a
prior measured on the machine (``anchored``) also speaks, at the window's speed, for the kinds of
step the window has (almost) not seen (``anchors``; ``docs/policies.md`` has the run that showed it).
"""

from __future__ import annotations

import math
from collections import Counter, deque
from dataclasses import dataclass, fields
from typing import Iterable, Sequence

from tandem.core.step import SchedulerOutput

TERMS = ("base", "per_token", "per_seq", "per_context", "per_pair", "per_prompt_step")
"""Coefficient names, in feature order (metrics label them so)."""

Features = tuple[float, float, float, float, float, float]
PROMPT = 5
"""Index of the prompt-step indicator in ``Features``: 1 or 0 per step, not a sum over its chunks."""


def features(spans: Iterable[tuple[int, int]]) -> Features:
    """(1, tokens, sequences, KV positions read, attention pairs, prompt step) of a step whose chunks
    are ``(start position, tokens)``; a chunk's queries each see the keys up to their own position,
    and the step is a prompt step when a chunk has more than one token."""
    tokens = seqs = context = pairs = 0
    prompt = 0.0
    for start, n in spans:
        tokens += n
        seqs += 1
        context += start + n
        pairs += n * start + n * (n + 1) // 2
        if n > 1:
            prompt = 1.0
    return (1.0, float(tokens), float(seqs), float(context), float(pairs), prompt)


def chunk_features(start: int, n: int) -> Features:
    """One chunk's share of ``features`` (no base): what adding it to a step adds."""
    return (0.0, float(n), 1.0, float(start + n), float(n * start + n * (n + 1) // 2), 1.0 if n > 1 else 0.0)


def add(a: Sequence[float], b: Sequence[float]) -> Features:
    """The features of a step with both ``a``'s and ``b``'s chunks (the prompt indicator is their max)."""
    out = [x + y for x, y in zip(a, b)]
    out[PROMPT] = max(a[PROMPT], b[PROMPT])
    return tuple(out)  # type: ignore[return-value]


@dataclass(frozen=True)
class StepCost:
    """Coefficients of the step-time formula (seconds); see the module docstring."""

    base: float = 0.010
    per_token: float = 0.0005
    per_seq: float = 0.0002
    per_context: float = 0.0
    per_pair: float = 0.0
    per_prompt_step: float = 0.0
    knee: float = 0.0
    """Sequences up to which ``per_seq`` is paid as if there were ``knee`` of them (not a coefficient:
    the online fit keeps it; a calibration picks it, ``fit_knee``)."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value >= 0:
                raise ValueError(f"{f.name}: a step-time coefficient must be a number >= 0, got {value!r}")

    def vector(self) -> Features:
        """The coefficients, in ``TERMS`` order (the knee is not one)."""
        return (self.base, self.per_token, self.per_seq, self.per_context, self.per_pair, self.per_prompt_step)

    def predict(self, x: Sequence[float]) -> float:
        # spelled out: the policy predicts a few times per chunk it sizes, every step
        seqs = x[2] if x[2] >= self.knee or x[2] <= 0 else self.knee
        return (self.base * x[0] + self.per_token * x[1] + self.per_seq * seqs + self.per_context * x[3]
                + self.per_pair * x[4] + self.per_prompt_step * x[5])

    def seconds(self, out: SchedulerOutput) -> float:
        return self.predict(features((c.start, c.num_tokens) for c in out.chunks))


@dataclass(frozen=True)
class Observation:
    x: Features
    seconds: float


class StepTimeModel:
    def __init__(self, prior: StepCost, window: int = 256, refit_every: int = 16, prior_weight: float = 0.1,
                 error_window: int = 1024, anchored: bool = False) -> None:
        if window < 1 or refit_every < 1:
            raise ValueError("step_model_window: the window and the refit period must be >= 1")
        self.prior = prior
        self.coefficients = prior
        self.prior_weight = prior_weight
        self.refit_every = refit_every
        self.window: deque[Observation] = deque(maxlen=window)
        self.errors: deque[float] = deque(maxlen=error_window)
        """Relative error (predicted - measured) / measured of each step predicted before it ran."""
        self._since_fit = 0
        self.anchored = anchored
        """The prior was measured on this machine (a start-up estimate): it speaks for the kinds of
        step the window lacks (``anchors``). A generic prior only regularizes."""
        self.speed = 1.0
        """The window's steps over the prior's prediction of them (``speed_factor``), at the last refit."""
        self.last: Observation | None = None
        """The most recent measured step (a policy settles what it planned against it)."""

    def predict(self, x: Sequence[float]) -> float:
        return self.coefficients.predict(x)

    def observe(self, x: Features, seconds: float, predicted: float | None = None) -> float | None:
        """Record a measured step; returns its relative prediction error when a prediction is given."""
        error = None
        if predicted is not None and seconds > 0:
            error = (predicted - seconds) / seconds
            self.errors.append(error)
        self.last = Observation(x, seconds)
        self.window.append(self.last)
        self._since_fit += 1
        if self._since_fit >= self.refit_every:
            self.refit()
        return error

    def refit(self) -> StepCost:
        self._since_fit = 0
        if self.window:
            knee = self.prior.knee
            observations = list(self.window)
            self.speed = speed_factor(observations, self.prior)
            target = [v * self.speed for v in self.prior.vector()]
            if self.anchored:
                observations += anchors(observations, self.prior, self.speed)
            self.coefficients = StepCost(*fit(observations, target, self.prior_weight, knee), knee=knee)
        return self.coefficients


def speed_factor(observations: Sequence[Observation], prior: StepCost) -> float:
    """How much longer than ``prior`` predicts the observed steps ran, as one factor ``m`` (least
    squares on relative error: ``m = sum r / sum r^2``, ``r = predicted / measured``); 1 where the
    prior predicts nothing."""
    r = [prior.predict(o.x) / o.seconds for o in observations if o.seconds > 0]
    r2 = sum(v * v for v in r)
    return sum(r) / r2 if r2 > 0 else 1.0


def _decodes(n: int, context: int = 256) -> Features:
    return features([(context, 1)] * n)


ANCHOR_SHAPES: tuple[Features, ...] = (
    _decodes(1), _decodes(4), _decodes(16), _decodes(64),
    features([(0, 16)]), features([(0, 128)]), features([(0, 512)]),
    add(_decodes(8), chunk_features(0, 16)), add(_decodes(16), chunk_features(256, 64)),
)
"""Shapes the online fit always hears about: decode batches, prompt chunks alone, small chunks
beside decodes. Where the window has too few steps like one, the prior speaks for it (``anchors``)."""
ANCHOR_SEEN = 4
"""Steps of an anchor's kind the window must hold before the prior stops speaking for it."""


def _kind(x: Sequence[float]) -> tuple[bool, int, int]:
    """A step's kind, for anchoring: prompt step or not, and its tokens and sequences to the nearest power of 2."""
    return x[PROMPT] > 0, round(math.log2(max(x[1], 1.0))), round(math.log2(max(x[2], 1.0)))


def anchors(observations: Sequence[Observation], prior: StepCost, speed: float) -> list[Observation]:
    """Pseudo-steps at the ``ANCHOR_SHAPES`` whose kind the window has seen fewer than ``ANCHOR_SEEN``
    times, each timed as ``prior`` predicts at the speed of the window's steps of its class (with
    prompt work or decodes only; ``speed``, the whole window's, where it has none): one step's
    worth of evidence each, so the window's own steps outweigh them wherever it has any."""
    seen = Counter(_kind(o.x) for o in observations)
    speeds = {}
    for prompt in (False, True):  # prefill and decode need not slow down alike (compute, memory)
        alike = [o for o in observations if (o.x[PROMPT] > 0) == prompt]
        speeds[prompt] = speed_factor(alike, prior) if alike else speed
    return [Observation(x, speeds[x[PROMPT] > 0] * prior.predict(x)) for x in ANCHOR_SHAPES
            if seen[_kind(x)] < ANCHOR_SEEN and prior.predict(x) > 0]


def kneed(x: Sequence[float], knee: float) -> list[float]:
    """``x`` with its sequences counted as ``StepCost.predict`` counts them under ``knee``."""
    out = list(x)
    if 0 < out[2] < knee:
        out[2] = knee
    return out


def fit(observations: Sequence[Observation], prior: Sequence[float], prior_weight: float,
        knee: float = 0.0) -> list[float]:
    """Non-negative ridge least squares on *relative* error: minimize
    sum ((y - x.c) / y)^2 + w * sum (s_j (c_j - p_j))^2, with ``s_j`` the RMS of x_j / y over the
    observations (so ``w`` counts pseudo-steps). Relative, because a decode step of 20 ms must be
    predicted as well as a prefill step of 2 s: the ITL budget is decided on the small ones.
    ``knee``: the sequences are counted as under that knee (a fixed knee keeps the fit linear)."""
    k = len(prior)
    rows = [([v / o.seconds for v in kneed(o.x, knee)], 1.0) for o in observations if o.seconds > 0]
    if not rows:
        return list(prior)
    scale = [(sum(z[j] ** 2 for z, _ in rows) / len(rows)) ** 0.5 for j in range(k)]
    # Normal equations in scaled coordinates u_j = c_j * s_j.
    gram = [[0.0] * k for _ in range(k)]
    rhs = [0.0] * k
    for z, y in rows:
        z = [z[j] / scale[j] if scale[j] else 0.0 for j in range(k)]
        for i in range(k):
            if z[i]:
                rhs[i] += z[i] * y
                for j in range(k):
                    gram[i][j] += z[i] * z[j]
    target = [prior[j] * scale[j] for j in range(k)]
    for j in range(k):
        gram[j][j] += prior_weight
        rhs[j] += prior_weight * target[j]
    free = list(range(k))
    while True:
        u = _solve([[gram[i][j] for j in free] for i in free], [rhs[i] for i in free])
        negative = [(v, j) for v, j in zip(u, free) if v < 0]
        if not negative:
            break
        # A coefficient that wants to be negative is pinned at 0 and the rest refitted: time never
        # falls when a step grows. Pinning lowers the dimension, so this ends.
        free.remove(min(negative)[1])
    solution = dict(zip(free, u))
    out = []
    for j in range(k):
        if j not in solution:
            out.append(0.0)
        elif scale[j]:
            out.append(solution[j] / scale[j])
        else:  # never seen: the data says nothing, the prior stands
            out.append(prior[j])
    return out


KNEES = (0.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0)
"""The knees ``fit_knee`` tries (0: no floor)."""


def fit_knee(observations: Sequence[Observation], prior: StepCost, prior_weight: float,
             knees: Sequence[float] = KNEES) -> StepCost:
    """``fit`` at each of ``knees``, the one whose relative errors have the least sum of squares
    (the fit's own objective); a knee that lowers it by less than 2% is not worth its bend, so a
    step cost without a floor keeps knee 0."""
    best: tuple[float, StepCost] | None = None
    for knee in knees:
        cost = StepCost(*fit(observations, prior.vector(), prior_weight, knee), knee=knee)
        sse = sum(((cost.predict(o.x) - o.seconds) / o.seconds) ** 2 for o in observations if o.seconds > 0)
        if best is None or sse < best[0] * 0.98:
            best = (sse, cost)
    assert best is not None
    return best[1]


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting (the system is small and positive definite)."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            for c in range(col, n + 1):
                m[r][c] -= f * m[col][c]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (m[r][n] - sum(m[r][c] * x[c] for c in range(r + 1, n))) / m[r][r]
    return x
