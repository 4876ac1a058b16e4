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
    """(step, seconds) for each shape: one untimed run first (its one-time costs; ``warm=False``
    skips it), then the median of ``repeats`` timed ones."""
    timed = []
    for i, spans in enumerate(shapes):
        out = step_for(layout, spans, f"timed-{i}")
        if warm:
            runner.execute(out)
        seconds = []
        for _ in range(repeats):
            t = time.perf_counter()
            runner.execute(out)
            seconds.append(time.perf_counter() - t)
        timed.append((spans, statistics.median(seconds)))
        if progress:
            progress(i + 1)
    return timed
