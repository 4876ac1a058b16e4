"""Latency and throughput definitions, used by the server's metrics and by the benchmark tools.

* TTFT: arrival -> first output token.         * ITL: gap between consecutive output tokens.
* TPOT: (E2E - TTFT) / (output tokens - 1).    * E2E: arrival -> last token.
* Stall: the largest ITL of a request.         * Goodput: completed requests/s meeting every SLO.
"""

from __future__ import annotations

import math
from typing import Iterable, Sequence


def tpot(ttft: float, e2e: float, num_output_tokens: int) -> float | None:
    if num_output_tokens < 2:
        return None
    return (e2e - ttft) / (num_output_tokens - 1)


def itls(token_times: Sequence[float]) -> list[float]:
    return [b - a for a, b in zip(token_times, token_times[1:])]


def stall(token_times: Sequence[float]) -> float | None:
    gaps = itls(token_times)
    return max(gaps) if gaps else None


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (as numpy's default), q in [0, 100]."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(values: Iterable[float | None], percentiles: Sequence[float]) -> dict[str, float]:
    """mean, median, std and the requested percentiles of the non-missing values."""
    xs = [v for v in values if v is not None and not math.isnan(v)]
    if not xs:
        return {"mean": math.nan, "median": math.nan, "std": math.nan, **{f"p{_q(q)}": math.nan for q in percentiles}}
    mean = sum(xs) / len(xs)
    std = math.sqrt(sum((x - mean) ** 2 for x in xs) / len(xs))
    out = {"mean": mean, "median": percentile(xs, 50), "std": std}
    for q in percentiles:
        out[f"p{_q(q)}"] = percentile(xs, q)
    return out


def _q(q: float) -> str:
    return str(int(q)) if float(q).is_integer() else str(q)
