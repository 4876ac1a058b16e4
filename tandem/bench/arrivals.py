"""When each request is sent: Poisson or gamma inter-arrival times, a constant rate, or all at
once. A closed loop (fixed concurrency) is the rate ``inf`` plus ``max_concurrency``, applied by
the sender."""

from __future__ import annotations

import math
import random

from tandem.bench.workload import ArrivalSpec


def arrival_offsets(spec: ArrivalSpec, n: int, seed: int) -> list[float]:
    """Send times in seconds from the start of the run, one per request, non-decreasing."""
    spec.validate()
    if math.isinf(spec.request_rate):
        return [0.0] * n
    if spec.process == "constant":
        return [i / spec.request_rate for i in range(n)]
    rng = random.Random(seed)
    # Gamma with shape k (the burstiness) and mean 1/rate: k = 1 is the exponential, i.e.
    # Poisson arrivals; k < 1 is burstier, k > 1 more regular (vLLM's --burstiness).
    shape = spec.burstiness
    scale = 1.0 / (spec.request_rate * shape)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.gammavariate(shape, scale)
    return out
