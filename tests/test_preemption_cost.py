"""Preemption's cost made visible: tokens recomputed after a preemption are counted apart from
first-time prefill, per chunk, per step, per request, in /metrics, the trace and the bench row."""

from __future__ import annotations

import json
from types import SimpleNamespace

from tandem.config import SchedulerConfig
from tandem.core.request import SamplingParams
from tandem.sim import StepCost, sim_engine


def forced_preemption(fairness="fcfs", prefix_caching=False):
    """Two requests of 8 prompt tokens and 8 output tokens in 6 blocks of 4 tokens: both run until
    each holds 3 blocks with 12 tokens of KV; growing r0 to 13 needs a fourth block, so r1 (ranked
    below) is preempted with 8 prompt + 5 generated tokens, 12 of them with KV. Once r0 finishes,
    r1 comes back and recomputes exactly those 12 (its 13th, the newest token, never had KV).
    Without the prefix cache: with it, r1 would reuse what is still cached (test_prefix_cache)."""
    engine = sim_engine(SchedulerConfig(max_num_seqs=2, fairness=fairness, enable_prefix_caching=prefix_caching),
                        StepCost(), num_kv_blocks=6, block_size=4)
    for i, user in enumerate(("a", "b")):
        engine.add_request(list(range(1, 9)), SamplingParams(max_tokens=8, ignore_eos=True), request_id=f"r{i}",
                           user=user)
    r1 = engine.scheduler.requests["r1"]
    outs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs[out.request_id] = out
        engine.scheduler.check_invariants()
    return engine, r1, outs


def test_recomputed_tokens_counted_exactly():
    engine, r1, outs = forced_preemption()
    assert engine.scheduler.num_preemptions == 1 and r1.timing.num_preemptions == 1
    assert r1.num_recomputed_tokens == 12 and engine.scheduler.num_recomputed_tokens == 12
    steps = [s for s in engine.step_stats if s.num_recomputed_tokens]
    assert len(steps) == 1
    (chunk,) = [c for c in steps[0].chunks if c.num_recomputed_tokens]
    assert (chunk.request_id, chunk.start, chunk.num_tokens, chunk.num_recomputed_tokens) == ("r1", 0, 13, 12)
    assert steps[0].num_prefill_tokens == 13  # the recompute is prefill work; 12 of it repeated
    assert sum(s.num_recomputed_tokens for s in engine.step_stats) == 12
    assert all(len(o.token_ids) == 8 for o in outs.values())


def test_no_preemption_no_recompute():
    engine = sim_engine(SchedulerConfig(max_num_seqs=2), StepCost())
    for i in range(3):
        engine.add_request(list(range(1, 30)), SamplingParams(max_tokens=5, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.scheduler.num_preemptions == 0 and engine.scheduler.num_recomputed_tokens == 0
    assert not any(c.num_recomputed_tokens for s in engine.step_stats for c in s.chunks)


def test_vtc_does_not_charge_recomputation():
    # each user: 8 prompt tokens at weight 1 + 8 sampled tokens at weight 2 = 24, recompute free
    engine, r1, _ = forced_preemption("vtc")
    assert r1.num_recomputed_tokens == 12
    assert engine.scheduler.fairness.counters == {"a": 24.0, "b": 24.0}


def test_trace_names_the_recompute(tmp_path):
    from tandem.trace import TraceRecorder

    engine, _, outs = forced_preemption()
    tracer = TraceRecorder(tmp_path / "t.json")
    for s in engine.step_stats:
        tracer.on_step(s)
    for out in outs.values():
        tracer.on_finish(out)
    events = json.loads(tracer.write().read_text())["traceEvents"]
    recomputes = [e for e in events if e.get("name", "").startswith("recompute")]
    assert [e["name"] for e in recomputes] == ["recompute 12 tok"]
    assert recomputes[0]["args"]["recomputed_tokens"] == 12
    prefills = sorted(e["name"] for e in events if e.get("name", "").startswith("prefill") and e["pid"] == 2)
    assert prefills == ["prefill 8 tok", "prefill 8 tok"]
    (step,) = [e for e in events if e.get("args", {}).get("recomputed_tokens") == 12 and e["tid"] == 0]
    assert step["args"]["prefill_tokens"] == 13


def test_metrics_counter_and_bench_row():
    from prometheus_client import generate_latest

    from tandem.bench.compare_report import table
    from tandem.bench.evaluate import Candidate, Evaluation
    from tandem.bench.results import row
    from tandem.bench.summary import counter_delta
    from tandem.server.prometheus import ServerMetrics
    from tandem.utilization import Peaks

    engine, _, outs = forced_preemption()
    cost = SimpleNamespace(step=lambda spans, sampled: (1.0, 1.0))
    metrics = ServerMetrics("m", cost, Peaks(1e9, 1e9, measured=False))
    assert 'tandem:recomputed_tokens_total{model_name="m"} 0.0' in generate_latest(metrics.registry).decode()
    for s in engine.step_stats:
        metrics.on_step(s, engine)
    assert 'tandem:recomputed_tokens_total{model_name="m"} 12.0' in generate_latest(metrics.registry).decode()

    summary = {k: 0.0 for k in ("completed", "failed", "output_throughput", "total_token_throughput", "median_ttft_ms",
                                "p99_ttft_ms", "median_itl_ms", "p99_itl_ms", "p99_stall_ms")}
    ev = Evaluation(Candidate("c", {}), summary, SimpleNamespace(results=[]), engine.step_stats, 1)
    assert row(ev)["recomputed_tokens"] == 12
    header, _, line = table([ev]).splitlines()
    column = header.rstrip("|").split("|").index(" recomputed tokens ")
    assert line.rstrip("|").split("|")[column].strip() == "12"
    samples = [(0.0, {"recomputed_tokens": 5.0}), (1.0, {"running": 1.0}), (2.0, {"recomputed_tokens": 17.0})]
    assert counter_delta(samples, "recomputed_tokens") == 12.0 and counter_delta(samples, "waiting") is None
