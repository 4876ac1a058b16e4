"""Step-time noise: a measured profile's spread of one step's time around its typical time, and
the factor a simulated step's forward pass is drawn with.

A real step does not cost the same each time it runs: a shared machine has slow spells, and the
p99 of a load's token gaps is set by its slowest steps. ``tandem calibrate`` times each designed
step several times, round by round (``tandem.runner.step_timing``); every timed run over the median
of its own step's runs is a sample of that spread, free of the step-time model's misfit. A
calibration also runs a short real engine load, whose steps ran slower or faster than the same
shapes timed back to back by the median of their measured / predicted forward times: the profile's
``in_load_scale``. The simulator multiplies each step's forward time by ``in_load_scale`` times a
draw from the samples, from a seeded generator, so a seed still reproduces a run. No torch.
"""

from __future__ import annotations

import random
import statistics
from typing import Sequence


class StepNoise:
    def __init__(self, ratios: Sequence[float] = (), scale: float = 1.0, seed: int = 0) -> None:
        if not scale > 0 or any(not r > 0 for r in ratios):
            raise ValueError("step_noise: the scale and every ratio must be > 0")
        self.ratios = tuple(ratios) or (1.0,)
        self.scale = scale
        self.rng = random.Random(seed)

    def factor(self) -> float:
        """What the next step's forward time is multiplied by."""
        return self.scale * (self.ratios[self.rng.randrange(len(self.ratios))] if len(self.ratios) > 1 else self.ratios[0])


def spread(samples: Sequence[Sequence[float]]) -> list[float]:
    """Each timed run over the median of its own step's runs, sorted; steps timed fewer than three
    times say nothing about a spread and are left out."""
    out = []
    for runs in samples:
        if len(runs) >= 3:
            m = statistics.median(runs)
            out.extend(r / m for r in runs if m > 0 and r > 0)
    return sorted(out)
