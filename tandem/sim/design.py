"""The designed set of steps a cost profile is fitted on: prompt chunks of several sizes (alone
and behind a long context), decode batches of several sizes at several context lengths, and mixed
steps (decodes beside a prompt chunk). `tandem calibrate` times them on the real engine; a
roofline profile prices them to fit the step-time model's start-up estimate. Either way the fit
is the step-time model's own (``tandem.core.step_time.fit``). No torch.
"""

from __future__ import annotations

from typing import Callable, Sequence

from tandem.core.step_time import KNEES, Observation, StepCost, features, fit_knee

Spans = list[tuple[int, int]]
"""One step: (start position, tokens) per sequence."""

PREFILL_SIZES = (16, 64, 256, 1024, 2048, 4096, 8192)
"""Those above ``max_chunk`` are left out (a CPU calibrates up to 2048 by default)."""
DECODE_BATCHES = (1, 4, 16, 64)
CONTEXTS = (128, 1024, 4096)


def design(kv_positions: int, max_len: int, max_batch: int = 64, max_chunk: int = 2048,
           block_size: int = 1) -> list[Spans]:
    """The steps to time: each sequence within ``max_len``, all of them (each in whole blocks of
    its own) within the ``kv_positions`` the calibration engine's cache has."""
    shapes: list[Spans] = []

    def keep(spans: Spans) -> None:
        used = sum(-(-(s + n) // block_size) * block_size for s, n in spans)
        if all(s + n <= max_len for s, n in spans) and used <= kv_positions:
            shapes.append(spans)

    # a small model's short context still gets two context lengths; a small batch limit its own batch
    contexts = sorted({min(c, max_len // 2) for c in CONTEXTS} | {min(CONTEXTS[0], max_len // 4)})
    batches = sorted({b for b in DECODE_BATCHES if b <= max_batch} | {max_batch})
    for n in PREFILL_SIZES:
        if n <= max_chunk:
            keep([(0, n)])
    for ctx in contexts:
        for b in batches:
            keep([(ctx, 1)] * b)
        for n in (256, 1024):  # chunks behind a long prompt: attention pairs grow with the context
            if n <= max_chunk:
                keep([(ctx, n)])
    for b in batches[1:]:
        for n in (64, 512):
            if n <= max_chunk:
                keep([(min(512, max_len // 2), 1)] * b + [(0, n)])
    return shapes


def compact(spans: Spans) -> list[list[int]]:
    """[start, tokens, count] runs of equal chunks, so a 64-sequence decode is one entry (how a
    profile records its timed steps)."""
    out: list[list[int]] = []
    for s, n in spans:
        if out and out[-1][:2] == [s, n]:
            out[-1][2] += 1
        else:
            out.append([s, n, 1])
    return out


def fit_shapes(timed: Sequence[tuple[Spans, float]], prior: StepCost | None = None,
               prior_weight: float = 0.01, knees: Sequence[float] = KNEES) -> StepCost:
    """The step-time model fitted to (step, seconds) pairs, barely pulled toward ``prior``, with the
    knee (``StepCost.knee``) that fits them best."""
    observations = [Observation(features(spans), seconds) for spans, seconds in timed if seconds > 0]
    return fit_knee(observations, prior or StepCost(), prior_weight, knees)


def fit_cost(seconds: Callable[[Spans], float], shapes: Sequence[Spans]) -> StepCost:
    """The StepCost closest to another cost model over the designed steps."""
    return fit_shapes([(spans, seconds(spans)) for spans in shapes])


def relative_errors(cost: StepCost, timed: Sequence[tuple[Spans, float]]) -> list[float]:
    return [(cost.predict(features(spans)) - s) / s for spans, s in timed if s > 0]
