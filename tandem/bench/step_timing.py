"""Time designed steps on the model runner: what a calibration and a speed check measure."""

from __future__ import annotations

import statistics
import time

from tandem.core.sampling_params import SamplingParams
from tandem.core.step import KVLayout, ScheduledChunk, SchedulerOutput
from tandem.sim.design import Spans


def time_steps(runner, layout: KVLayout, shapes: list[Spans], repeats: int, progress=None) -> list[tuple[Spans, float]]:
    """(step, seconds) for each shape: one untimed run (its one-time costs), then the median of
    ``repeats`` timed ones. Each sequence writes its own stretch of ``layout``'s cache."""
    params = SamplingParams(max_tokens=1, temperature=0.0)
    timed = []
    for i, spans in enumerate(shapes):
        # each sequence gets its own stretch of the cache, as separate requests would
        chunks, offset = [], 0
        for j, (start, n) in enumerate(spans):
            blocks = layout.blocks_for(start + n)
            chunks.append(ScheduledChunk(f"calibrate-{i}-{j}", start, (1,) * n, tuple(range(offset, offset + blocks)),
                                         params, True, n == 1, start + n))
            offset += blocks
        out = SchedulerOutput(step_id=0, chunks=tuple(chunks))
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
