"""Several runs of one configuration read as one: each metric's median over the runs.

On a shared machine a p99 moves by tens of percent between identical runs (a 2-core VM: TTFT p99
915 and 1,400 ms for the same configuration and requests). `tandem compare --repeats N` runs every
configuration N times, round by round (each configuration once, then each again), so a slow spell
of the machine falls on all of them alike, and reports medians; `tandem tune` judges its leaders
the same way. ``merge`` keeps, for the plots and per-class tables, the run whose TTFT p99 is the
median one, and each run's figures (the report's *Repeats* section, ``compare_report``).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from typing import Sequence

KEYS = ("output_throughput", "total_token_throughput", "request_goodput", "median_ttft_ms", "p99_ttft_ms",
        "median_itl_ms", "p99_itl_ms", "p99_stall_ms", "completed", "failed")
"""The summary figures a repeated configuration is judged on (medians over its runs)."""


def median(values: Sequence[float | None]) -> float:
    """Median of the values; a missing value counts as NaN, and any NaN makes the median NaN
    (a run that could not measure a figure must not be outvoted into a number)."""
    xs = [math.nan if v is None else float(v) for v in values]
    if not xs or any(math.isnan(x) for x in xs):
        return math.nan
    return statistics.median(xs)


def median_summary(summaries: Sequence[dict], keys: Sequence[str] = KEYS) -> dict:
    return {k: median([s.get(k) for s in summaries]) for k in keys}


def _sort_key(v) -> float:
    return math.inf if v is None or (isinstance(v, float) and math.isnan(v)) else v


def merge(runs: list):
    """Evaluations of one configuration (``tandem.bench.evaluate.Evaluation``) -> one whose summary
    holds the medians of ``KEYS`` (MFU/MBU too), whose data and steps are the median-TTFT-p99 run's,
    and whose ``runs`` lists each run's figures in order."""
    if len(runs) == 1:
        return runs[0]
    order = sorted(range(len(runs)), key=lambda i: _sort_key(runs[i].summary.get("p99_ttft_ms")))
    middle = runs[order[(len(runs) - 1) // 2]]
    per_run = [{**{k: r.summary.get(k) for k in KEYS}, "mfu": r.mfu, "mbu": r.mbu} for r in runs]
    medians = median_summary([r.summary for r in runs])
    for k in ("completed", "failed"):  # counts stay integers
        if not math.isnan(medians[k]):
            medians[k] = int(medians[k])
    util = {k: (None if any(p[k] is None for p in per_run) else median([p[k] for p in per_run]))
            for k in ("mfu", "mbu")}
    return dataclasses.replace(middle, summary={**middle.summary, **medians}, runs=per_run, **util)
