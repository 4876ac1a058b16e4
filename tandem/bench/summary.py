"""Summary statistics of a run, keyed as vLLM's ``bench serve`` result.json keys them."""

from __future__ import annotations

from collections import Counter
from typing import Sequence

from tandem.bench.client import RequestResult
from tandem.core.burst_pause import END_REASONS
from tandem.core.step import SIZING_LIMITS
from tandem.latency import percentile, summarize

METRICS = ("ttft", "tpot", "itl", "e2el", "stall")
GOODPUT_METRICS = ("ttft", "tpot", "e2el")


def parse_goodput(items: Sequence[str] | None) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` -> {"ttft": 0.5, "tpot": 0.05} (milliseconds in, seconds out)."""
    slos: dict[str, float] = {}
    for item in items or ():
        name, sep, value = item.partition(":")
        if not sep or name not in GOODPUT_METRICS:
            raise ValueError(f"goodput: expected NAME:MS with NAME in {', '.join(GOODPUT_METRICS)}, got {item!r}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"goodput: {item!r} has no number of milliseconds") from None
        if ms <= 0:
            raise ValueError(f"goodput: {item!r} must be > 0 ms")
        slos[name] = ms / 1000.0
    return slos


def meets(r: RequestResult, slos: dict[str, float]) -> bool:
    if not r.success:
        return False
    values = {"ttft": r.ttft, "tpot": r.tpot, "e2el": r.e2e}
    for name, limit in slos.items():
        value = values[name]
        if value is None:
            if name == "tpot":  # a one-token request has no TPOT: it cannot miss that objective
                continue
            return False
        if value > limit:
            return False
    return True


def _values(results: list[RequestResult], metric: str) -> list[float]:
    ok = [r for r in results if r.success]
    if metric == "itl":
        return [g for r in ok for g in r.itls]
    attr = {"ttft": "ttft", "tpot": "tpot", "e2el": "e2e", "stall": "stall"}[metric]
    return [v for v in (getattr(r, attr) for r in ok) if v is not None]


def summarize_run(results: list[RequestResult], duration: float, percentiles: Sequence[float],
                  metrics: Sequence[str] = METRICS, slos: dict[str, float] | None = None) -> dict:
    ok = [r for r in results if r.success]
    input_tokens = sum((r.prompt_tokens if r.prompt_tokens is not None else r.target_input_len) for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    duration = max(duration, 1e-9)
    out: dict = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": dict(Counter(r.error or "unknown" for r in results if not r.success)),
        "duration": duration,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
    }
    cached = [r.cached_tokens for r in ok if r.cached_tokens is not None]
    if cached:  # the server reports its prefix-cache use per response
        out["cached_prompt_tokens"] = sum(cached)
        out["cached_prompt_fraction"] = sum(cached) / max(input_tokens, 1)
    if slos:
        good = sum(1 for r in ok if meets(r, slos))
        out["request_goodput"] = good / duration
        out["goodput_fraction"] = good / len(results) if results else 0.0
    for m in metrics:
        stats = summarize(_values(results, m), percentiles)
        for k, v in stats.items():
            out[f"{k}_{m}_ms"] = v * 1000.0
    return out


def counter_delta(samples: list[tuple[float, dict[str, float]]], key: str) -> float | None:
    """How much a server counter scraped during a run grew (its last value less its first); None
    when the server does not export it."""
    values = [g[key] for _, g in samples if key in g]
    return values[-1] - values[0] if values else None


def sizing_summary(samples: list[tuple[float, dict[str, float]]]) -> dict[str, float]:
    """Under an ITL target (tandem only): the steps the run sized by what set their prompt work
    (``itl``, ``ttft``, ``overrun``, ``pause``, ``none``; counter deltas), the burst pauses it ended by why
    (``burst_pause.END_REASONS``) and the median target T over its samples."""
    out: dict[str, float] = {}
    for sampled, summed, labels in (("sized_", "steps_sized_", SIZING_LIMITS), ("pause_end_", "pause_ends_", END_REASONS)):
        counts = {label: counter_delta(samples, sampled + label) for label in labels}
        if any(counts.values()):
            out.update({summed + label: n for label, n in counts.items() if n is not None})
    targets = [g["itl_target"] for _, g in samples if g.get("itl_target")]
    if targets:
        out["median_itl_target_ms"] = percentile(targets, 50) * 1000.0
    return out


def per_class(results: list[RequestResult], duration: float, percentiles: Sequence[float],
              metrics: Sequence[str], slos: dict[str, float] | None) -> dict[str, dict]:
    names = sorted({r.class_name for r in results})
    return {n: summarize_run([r for r in results if r.class_name == n], duration, percentiles, metrics, slos)
            for n in names}


def per_user(results: list[RequestResult], duration: float, percentiles: Sequence[float],
             metrics: Sequence[str], slos: dict[str, float] | None) -> dict[str, dict]:
    """Like ``per_class``, keyed by tenant; empty when no request names a user."""
    names = sorted({r.user for r in results if r.user})
    return {n: summarize_run([r for r in results if r.user == n], duration, percentiles, metrics, slos)
            for n in names}
