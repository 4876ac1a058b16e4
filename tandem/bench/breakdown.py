"""A comparison split by request class and by user: what one group of requests got under each
configuration (the chat class's TTFT with and without the long-prefill cap; light users' TTFT
under fcfs and vtc), beside each configuration's total output throughput."""

from __future__ import annotations

import math

from tandem.bench.evaluate import Evaluation
from tandem.bench.summary import per_class, per_user

_PERCENTILES = [50, 90, 99]
_METRICS = ("ttft", "itl")


def _f(v) -> str:
    return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:,.0f}"


def groups(evaluations: list[Evaluation], by: str) -> dict[str, dict[str, dict]]:
    """{configuration: {group: summary}} with ``by`` "class" or "user"."""
    split = per_class if by == "class" else per_user
    return {e.candidate.name: split(e.data.results, e.data.duration, _PERCENTILES, _METRICS, None)
            for e in evaluations}


def table(evaluations: list[Evaluation], by: str) -> str:
    """Rows: each group's TTFT p50 / p99 and ITL p99 under every configuration; empty when there
    is only one group (the main table says it all)."""
    data = groups(evaluations, by)
    names = sorted({g for per in data.values() for g in per})
    if len(names) < 2:
        return ""
    lines = [f"| {by} | configuration | completed | TTFT p50 / p99 (ms) | ITL p99 (ms) |", "|---|---|---|---|---|"]
    for name in names:
        for e in evaluations:
            s = data[e.candidate.name].get(name)
            if s is None:
                continue
            lines.append(f"| {name} | {e.candidate.name} | {s['completed']} | {_f(s.get('median_ttft_ms'))} / "
                         f"{_f(s.get('p99_ttft_ms'))} | {_f(s.get('p99_itl_ms'))} |")
    return "\n".join(lines)


def json_data(evaluations: list[Evaluation]) -> dict:
    keep = ("completed", "output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms")
    out = {}
    for by in ("class", "user"):
        data = groups(evaluations, by)
        if sum(len(v) for v in data.values()):
            out[f"per_{by}"] = {c: {g: {k: s.get(k) for k in keep} for g, s in per.items()} for c, per in data.items()}
    return out
