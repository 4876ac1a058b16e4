"""Time designed steps on the model runner: what a calibration, a speed check and
``--quantization auto`` measure."""

from __future__ import annotations

import statistics
import time

from tandem.core.sampling_params import SamplingParams
from tandem.core.step import KVLayout, ScheduledChunk, SchedulerOutput
from tandem.sim.design import Spans


def step_for(layout: KVLayout, spans: Spans, name: str = "timed") -> SchedulerOutput:
    """A step computing ``spans``, each sequence writing its own stretch of ``layout``'s cache, as
    separate requests would."""
    params = SamplingParams(max_tokens=1, temperature=0.0)
    chunks, offset = [], 0
    for j, (start, n) in enumerate(spans):
        blocks = layout.blocks_for(start + n)
        chunks.append(ScheduledChunk(f"{name}-{j}", start, (1,) * n, tuple(range(offset, offset + blocks)),
                                     params, True, n == 1, start + n))
        offset += blocks
    return SchedulerOutput(step_id=0, chunks=tuple(chunks))


def blocks_needed(layout: KVLayout, shapes: list[Spans]) -> int:
    """KV blocks the largest of ``shapes`` takes under ``step_for``."""
    return max(sum(layout.blocks_for(start + n) for start, n in spans) for spans in shapes)


def time_steps(runner, layout: KVLayout, shapes: list[Spans], repeats: int, progress=None,
               warm: bool = True) -> list[tuple[Spans, float]]:
    """(step, seconds) for each shape: the median of ``time_step_samples``' runs."""
    return [(spans, statistics.median(runs))
            for spans, runs in time_step_samples(runner, layout, shapes, repeats, progress, warm)]


def time_step_samples(runner, layout: KVLayout, shapes: list[Spans], repeats: int, progress=None,
                      warm: bool = True) -> list[tuple[Spans, list[float]]]:
    """(step, the seconds of each timed run) for each shape: one untimed run of each first (its
    one-time costs; ``warm=False`` skips it), then ``repeats`` timed ones. The repeats go round by
    round through all the shapes, not shape by shape: a slow spell of a shared machine (seconds
    long) then costs each shape one slow sample, which a median drops, instead of every sample of
    the one or two shapes it fell on. ``progress`` is told the shapes done (a fraction when a
    round is part way)."""
    outs = [step_for(layout, spans, f"timed-{i}") for i, spans in enumerate(shapes)]
    if warm:
        for out in outs:
            runner.execute(out)
    seconds: list[list[float]] = [[] for _ in shapes]
    for r in range(repeats):
        for i, out in enumerate(outs):
            t = time.perf_counter()
            runner.execute(out)
            seconds[i].append(time.perf_counter() - t)
            if progress:
                progress((r * len(outs) + i + 1) / repeats)
    return list(zip(shapes, seconds))
