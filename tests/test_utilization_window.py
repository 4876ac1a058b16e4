"""The utilization gauges average over the steps of the last ``window_s`` seconds: the running
sums they keep (O(1) per step) agree with summing the window's steps afresh."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from tandem.core.outputs import ChunkStat, StepStats
from tandem.server.prometheus import ServerMetrics
from tandem.utilization import ModelCost, Peaks

COST = ModelCost(layer_params=1000, head_params=500, attn_flops_per_pair=3, kv_bytes_per_token=8, weight_bytes=1)


def test_window_sums_match_the_steps_inside_it():
    metrics = ServerMetrics("m", COST, Peaks(1e6, 1e6, True), window_s=2.0)
    view = SimpleNamespace(num_running=1, num_waiting=0, scheduler=SimpleNamespace(fairness=None))
    rng = random.Random(7)
    steps, t = [], 0.0
    for i in range(400):
        duration = rng.uniform(0.001, 0.05)
        t += duration + (rng.uniform(1.0, 3.0) if i % 97 == 0 else rng.uniform(0.0, 0.01))  # some idle gaps
        n = rng.randint(1, 64)
        s = StepStats(step_id=i, start=t - duration, duration=duration, forward_seconds=duration, kind="mixed",
                      num_prefill_tokens=n, num_decode_tokens=1, num_seqs=2, kv_blocks_used=1, kv_blocks_total=4,
                      num_preempted=0, num_waiting=0, num_running=2,
                      chunks=(ChunkStat("a", 10 * i, n, False, True), ChunkStat("b", 5, 1, True, True)))
        metrics.on_step(s, view)
        flops, nbytes = COST.step(s.spans(), s.num_sampled)
        steps.append((t, duration, flops, nbytes))
        inside = [x for x in steps if x[0] >= t - 2.0]
        busy = sum(x[1] for x in inside)

        def gauge(name: str) -> float:
            return metrics.registry.get_sample_value(name, {"model_name": "m"})

        assert gauge("tandem:engine_busy_fraction") == pytest.approx(min(1.0, busy / 2.0), rel=1e-9)
        assert gauge("tandem:model_flops_utilization") == pytest.approx(sum(x[2] for x in inside) / busy / 1e6, rel=1e-9)
        assert gauge("tandem:memory_bandwidth_utilization") == pytest.approx(sum(x[3] for x in inside) / busy / 1e6,
                                                                            rel=1e-9)
