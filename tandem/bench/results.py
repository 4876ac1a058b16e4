"""Evaluations as plain result data: one flat row per configuration, and compare.json."""

from __future__ import annotations

import json

from tandem.bench.evaluate import Evaluation
from tandem.bench.summary import counter_delta


def row(ev: Evaluation) -> dict:
    s = ev.summary
    out = {
        "config": ev.candidate.name, **ev.candidate.overrides,
        "completed": s["completed"], "failed": s["failed"],
        "output_throughput": s["output_throughput"], "total_token_throughput": s["total_token_throughput"],
        "median_ttft_ms": s["median_ttft_ms"], "p99_ttft_ms": s["p99_ttft_ms"],
        "median_itl_ms": s["median_itl_ms"], "p99_itl_ms": s["p99_itl_ms"],
        "p99_stall_ms": s["p99_stall_ms"], "request_goodput": s.get("request_goodput"),
        "mfu": ev.mfu, "mbu": ev.mbu, "preemptions": ev.preemptions,
        "recomputed_tokens": sum(s.num_recomputed_tokens for s in ev.steps),
        "prefill_tokens": sum(s.num_prefill_tokens for s in ev.steps),
        "cached_tokens": sum(s.num_cached_tokens for s in ev.steps),
        "steps": len(ev.steps),
    }
    if ev.replicas is not None:
        out["routing_summary"] = ev.replicas
    if ev.server is not None:  # a launched server: what its responses and /metrics said, not its steps
        cached = s.get("cached_prompt_tokens", 0)
        recomputed = counter_delta(ev.data.samples, "recomputed_tokens")
        out.update(recomputed_tokens=int(recomputed) if recomputed is not None else None, cached_tokens=cached,
                   prefill_tokens=s["total_input_tokens"] - cached, steps=None, server=ev.server)
    return out


def results_json(evaluations: list[Evaluation], meta: dict) -> str:
    return json.dumps({**meta, "configs": [row(e) for e in evaluations]}, indent=1, default=str)
