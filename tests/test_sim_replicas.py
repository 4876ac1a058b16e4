"""N simulated replicas behind the serving router: parallel in virtual time, each policy's choice,
stale reports, every KV block back at the end, and the replica keys of simulate's --configs."""

from __future__ import annotations

import json
import math

import pytest

from tandem.bench.compare import run_compare
from tandem.bench.config import SimulateConfig
from tandem.bench.evaluate import Candidate
from tandem.bench.prompts import BenchRequest
from tandem.bench.replay import run_inprocess
from tandem.bench.simulate import run_simulate
from tandem.bench.workload import ArrivalSpec
from tandem.config import EngineConfig, SchedulerConfig
from tandem.core.sampling_params import SamplingParams
from tandem.core.step_time import StepCost
from tandem.sim import sim_engine
from tandem.sim.replicas import ReplicatedSimEngine
from test_simulate import MEASURED

COST = StepCost(base=0.01, per_token=0.0005)
PARAMS = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


def _replicas(n: int, routing: str = "prefix-aware", period: float = 0.5, **kw) -> ReplicatedSimEngine:
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, **kw)
    return ReplicatedSimEngine([sim_engine(config, COST, num_kv_blocks=512) for _ in range(n)], routing,
                               stats_period=period)


def _words(tag: str, n: int) -> str:
    return " ".join(f"{tag}{j}" for j in range(n))


def _replay(engine, requests, offsets):
    data = run_inprocess(engine, requests, offsets, ArrivalSpec(request_rate=math.inf), True, 1e6)
    assert all(r.success for r in data.results)
    return data


def _drain(engine) -> None:
    while engine.has_unfinished_requests():
        engine.step()


def _all_free(engine: ReplicatedSimEngine) -> None:
    for e in engine.engines:
        e.allocator.check_invariants()
        assert e.allocator.all_free()
        assert not e.has_unfinished_requests()


def test_two_replicas_do_twice_the_work_in_the_same_virtual_time():
    requests = [BenchRequest(i, "c", _words(f"r{i}w", 64), 64, 32) for i in range(48)]
    offsets = [0.0] * len(requests)
    one, two = _replicas(1, "round-robin"), _replicas(2, "round-robin")
    d1, d2 = _replay(one, requests, offsets), _replay(two, requests, offsets)
    assert 1.8 < d1.duration / d2.duration < 2.2
    assert two.routing_summary()["requests_per_replica"] == [24, 24]
    assert len(two.step_stats) == sum(len(e.step_stats) for e in two.engines)
    _all_free(one)
    _all_free(two)
    # one replica behind the router is exactly the plain engine
    plain = sim_engine(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256), COST, num_kv_blocks=512)
    d0 = _replay(plain, requests, offsets)
    assert d0.duration == d1.duration
    assert [r.token_times for r in d0.results] == [r.token_times for r in d1.results]


def test_round_robin_alternates_and_ids_stay_unique():
    engine = _replicas(3, "round-robin")
    ids = [engine.add_request(_words("x", 40), PARAMS) for _ in range(7)]
    assert len(set(ids)) == 7
    assert [engine.replica_of(i) for i in ids] == [f"replica-{k % 3}" for k in range(7)]
    with pytest.raises(ValueError, match="request_id"):
        engine.add_request(_words("x", 40), PARAMS, request_id=ids[0])
    _drain(engine)
    _all_free(engine)


def _prefix_load():
    """3 system prompts of 8 blocks, 10 questions behind each, interleaved, one every 0.1 s."""
    requests, prefix_of = [], []
    for i in range(30):
        p = i % 3
        requests.append(BenchRequest(i, "q", _words(f"sys{p}w", 128) + " " + _words(f"q{i}w", 24), 152, 16))
        prefix_of.append(p)
    return requests, [0.1 * i for i in range(30)], prefix_of


def test_prefix_aware_keeps_each_prefix_on_one_replica_and_hits_more_than_round_robin():
    requests, offsets, prefix_of = _prefix_load()
    shares = {}
    for routing in ("prefix-aware", "round-robin"):
        engine = _replicas(2, routing, enable_prefix_caching=True)
        _replay(engine, requests, offsets)
        _all_free(engine)
        placed = {}
        for rid, decision in engine.decisions.items():
            placed.setdefault(prefix_of[int(rid.split("-")[1])], set()).add(decision.replica)
        summary = engine.routing_summary()
        shares[routing] = summary["prefix_hit_share"]
        if routing == "prefix-aware":
            assert all(len(where) == 1 for where in placed.values()), placed
            assert len(set().union(*placed.values())) == 2  # both replicas used
            reasons = summary["per_replica"][0]["reasons"] | summary["per_replica"][1]["reasons"]
            assert set(reasons) <= {"prefix", "least-loaded"} and "prefix" in reasons
        else:
            assert all(len(where) == 2 for where in placed.values())
    assert shares["prefix-aware"] > shares["round-robin"] > 0


def test_least_loaded_balances_a_skewed_load():
    # big and small prompts alternate: round-robin puts every big one on one replica
    sizes = [1200 if i % 2 == 0 else 40 for i in range(16)]
    spans = {}
    for routing in ("least-loaded", "round-robin"):
        engine = _replicas(2, routing)
        tokens = {"replica-0": 0, "replica-1": 0}
        for i, n in enumerate(sizes):
            rid = engine.add_request(_words(f"s{i}w", n), PARAMS)
            tokens[engine.replica_of(rid)] += n + PARAMS.max_tokens
        _drain(engine)
        _all_free(engine)
        spans[routing] = engine.clock()
        low, high = sorted(tokens.values())
        if routing == "least-loaded":
            assert low / high > 0.8, tokens
        else:
            assert low / high < 0.1, tokens
    assert spans["least-loaded"] < 0.75 * spans["round-robin"]


def test_reports_are_stale_between_periods():
    requests = [BenchRequest(i, "c", _words(f"r{i}w", 64), 64, 16) for i in range(40)]
    offsets = [0.05 * i for i in range(40)]
    counts = {}
    for period in (0.5, 1e9):
        engine = _replicas(2, "least-loaded", period=period)
        sent = []
        report = engine.router.report
        engine.router.report = lambda name, r, report=report: (sent.append(name), report(name, r))[1]
        data = _replay(engine, requests, offsets)
        counts[period] = len(sent)
        if period == 0.5:
            assert 2 < len(sent) <= 2 * (data.duration / period + 2)
        # the router's own record balances the load even when it never hears from the replicas again
        assert engine.routing_summary()["requests_per_replica"] in ([20, 20], [21, 19], [19, 21])
    assert counts[1e9] == 2  # the first report of each replica, then none


def test_simulate_reports_replicas_and_is_deterministic(tmp_path):
    profile = tmp_path / "p.json"
    profile.write_text(json.dumps(MEASURED))
    runs = []
    for i in range(2):
        cfg = SimulateConfig(scenario="shared-prefix", configs=("replicas=2,routing=prefix-aware",),
                             profile=str(profile), result_dir=str(tmp_path / f"r{i}"), seed=1)
        run_simulate(cfg)
        runs.append(json.loads((tmp_path / f"r{i}" / "compare.json").read_text()))
    strip = lambda d: [{k: v for k, v in r.items() if k != "date"} for r in d["configs"]]  # noqa: E731
    assert strip(runs[0]) == strip(runs[1])
    row = runs[0]["configs"][0]
    routing = row["routing_summary"]
    assert row["replicas"] == 2 and routing["routing"] == "prefix-aware"
    assert sum(routing["requests_per_replica"]) == row["completed"] == runs[0]["num_requests"]
    assert 0 < routing["prefix_hit_share"] <= 1
    md = (tmp_path / "r0" / "compare.md").read_text()
    assert "## Replicas" in md and "prefix-hit share" in md


@pytest.mark.parametrize("text, key", [
    ("replicas=0", "replicas"), ("replicas=two", "replicas"), ("routing=random", "routing"),
    ("replicas=2,routing_stats_period=0", "routing_stats_period"),
    ("routing_imbalance_tokens=-1", "routing_imbalance_tokens"), ("replica=2", "replica=2"),
])
def test_a_bad_replica_key_or_value_names_it(text, key):
    with pytest.raises(ValueError, match=key):
        Candidate.parse(text)


def test_compare_in_process_refuses_replica_keys_before_loading_a_model(tmp_path):
    assert Candidate.parse("replicas=2,routing=least-loaded").overrides == {"replicas": 2, "routing": "least-loaded"}
    with pytest.raises(ValueError, match="routing: the in-process engine is one replica"):
        run_compare("equal", None, ["policy=chunked", "routing=round-robin"], EngineConfig(), str(tmp_path))


def test_tune_searches_replicas_and_routing_in_the_simulator(tmp_path):
    from tandem.bench.config import TuneConfig
    from tandem.bench.tune_run import run_tune
    from tandem.config import EngineConfig

    cfg = TuneConfig(scenario="equal", slo_ttft_ms=60_000, slo_itl_ms=60_000, chunk_sizes="256,1024",
                     max_num_seqs_values="16", max_trials=6, simulate="h100-sxm/llama-3.1-8b", confirm=0,
                     replicas_values="1,2", routing_values="round-robin,prefix-aware", result_dir=str(tmp_path))
    result = run_tune(cfg, EngineConfig())["result"]
    tried = {(t.overrides.get("replicas"), t.overrides.get("routing")) for t in result.trials}
    assert tried == {(1, None), (2, "round-robin"), (2, "prefix-aware")}
    best = result.best.summary["output_throughput"]
    assert best == max(t.summary["output_throughput"] for t in result.trials if t.overrides.get("replicas") == 2) \
        or not result.feasible
    assert "--replicas" in result.command or result.best.overrides.get("replicas") == 1


def test_tune_refuses_replicas_in_process(tmp_path):
    from tandem.bench.config import TuneConfig
    from tandem.bench.tune_run import run_tune
    from tandem.config import EngineConfig

    cfg = TuneConfig(scenario="equal", slo_ttft_ms=1000, replicas_values="1,2", result_dir=str(tmp_path))
    with pytest.raises(ValueError, match="replicas_values"):
        run_tune(cfg, EngineConfig(), evaluator=None)
