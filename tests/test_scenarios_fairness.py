"""The scenarios that prove the target and fairness work: users in workloads and requests, the
built-in scenarios' requests, typed compare/tune keys, the ITL/TTFT frontier, and tune's search
over ITL targets. All on the simulator: no model."""

from __future__ import annotations

import json

import pytest

from tandem.bench import frontier
from tandem.bench.client import RequestResult, request_body
from tandem.bench.compare import run_compare
from tandem.bench.config import TuneConfig
from tandem.bench.config_keys import parse_overrides, parse_value
from tandem.bench.evaluate import Candidate, Evaluation
from tandem.bench.prompts import BenchRequest, build_requests
from tandem.bench.replay import run_inprocess
from tandem.bench.scenarios import SCENARIOS, scenario_requests
from tandem.bench.summary import per_user
from tandem.bench.tune import SLO, best_by_kind, tune
from tandem.bench.tune_report import write_tune_report
from tandem.bench.workload import ArrivalSpec, LengthDist, RequestClass, Workload
from tandem.config import EngineConfig, SchedulerConfig
from tandem.sim import SimTokenizer, StepCost, sim_engine

COST = StepCost(base=0.010, per_token=0.001, per_seq=0.0)


class SimEvaluator:
    tokenizer = SimTokenizer()

    def engine(self, overrides):
        return sim_engine(SchedulerConfig(**overrides), COST, num_kv_blocks=8192)


# --- users --------------------------------------------------------------------------------------

def test_a_class_names_its_users_by_pattern():
    w = Workload(num_prompts=7, classes=[
        RequestClass("light", 1.0, LengthDist("fixed", 8), LengthDist("fixed", 4), user="light-{i%3}")])
    users = [r.user for r in build_requests(w, SimTokenizer())]
    assert users == ["light-0", "light-1", "light-2", "light-0", "light-1", "light-2", "light-0"]
    w = Workload(num_prompts=2, classes=[RequestClass("a", user="u{i}")])
    assert [r.user for r in build_requests(w, SimTokenizer())] == ["u0", "u1"]
    for bad in ("x{j}", "x{i%0}", "x{", "tab\there"):
        with pytest.raises(ValueError, match=r"classes\[default\]\.user"):
            Workload(classes=[RequestClass(user=bad)]).validate()
    d = Workload(classes=[RequestClass(user="light-{i%3}")]).to_dict()
    assert Workload.from_dict(d).classes[0].user == "light-{i%3}"


def test_the_user_is_sent_and_reported_per_user():
    req = BenchRequest(0, "light", "hello", 1, 4, user="light-1")
    assert request_body(req, None, chat=True, ignore_eos=False)["user"] == "light-1"
    assert "user" not in request_body(BenchRequest(1, "c", "hi", 1, 4), None, chat=False, ignore_eos=False)
    res = RequestResult.of(req, 0.0)
    assert res.to_dict()["user"] == "light-1"
    results = []
    for i, (user, ttft) in enumerate([("a", 0.1), ("a", 0.3), ("b", 2.0), ("", 0.5)]):
        r = RequestResult.of(BenchRequest(i, "c", "x", 1, 2, user=user), 0.0, success=True, output_tokens=2)
        r.token_times, r.finish_time = [ttft, ttft + 0.01], ttft + 0.01
        results.append(r)
    users = per_user(results, 1.0, [50, 99], ("ttft",), None)
    assert set(users) == {"a", "b"}  # anonymous requests belong to no user
    assert users["b"]["p99_ttft_ms"] == pytest.approx(2000)
    assert users["a"]["completed"] == 2


class _TenantEngine:
    """A sim engine that records who sent what."""

    def __init__(self, engine):
        self._engine, self.users = engine, []

    def add_request(self, prompt, params=None, user: str = "", arrival_time=None):
        self.users.append(user)
        return self._engine.add_request(prompt, params, user=user, arrival_time=arrival_time)

    def __getattr__(self, name):
        return getattr(self._engine, name)


def test_the_in_process_engine_gets_the_user():
    reqs = [BenchRequest(i, "c", "a b c d", 4, 3, user=f"u{i % 2}") for i in range(4)]
    engine = _TenantEngine(sim_engine(SchedulerConfig(), COST))
    data = run_inprocess(engine, reqs, [0.0] * 4, ArrivalSpec(), True, 60)
    assert engine.users == ["u0", "u1", "u0", "u1"]
    assert [r.user for r in data.results] == ["u0", "u1", "u0", "u1"] and all(r.success for r in data.results)


# --- scenarios ----------------------------------------------------------------------------------

def test_power_user_scenario_is_deterministic_and_mostly_one_user():
    tok = SimTokenizer()
    reqs, offsets = SCENARIOS["power-user"].build(tok, 0)
    again, offsets2 = SCENARIOS["power-user"].build(tok, 0)
    assert [(r.prompt, r.user, r.output_len) for r in reqs] == [(r.prompt, r.user, r.output_len) for r in again]
    assert offsets == offsets2 and [r.index for r in reqs] == list(range(len(reqs)))
    power = [i for i, r in enumerate(reqs) if r.user == "power"]
    light = [i for i, r in enumerate(reqs) if r.user.startswith("light-")]
    assert len(power) + len(light) == len(reqs) and len(power) > 2 * len(light)
    assert {reqs[i].user for i in light} == {"light-0", "light-1", "light-2"}
    assert {reqs[i].class_name for i in light} == {"light"}
    # bursts: the power user's requests share a few send times; light ones are spread out
    assert len({offsets[i] for i in power}) == 2 and len({offsets[i] for i in light}) == len(light)
    assert SCENARIOS["power-user"].max_num_seqs < 32  # so that requests queue and the order matters
    assert {Candidate.parse(c).overrides["fairness"] for c in SCENARIOS["power-user"].configs} \
        == {"fcfs", "vtc"}


def test_long_prompts_has_chats_arriving_behind_the_documents():
    reqs, offsets = SCENARIOS["long-prompts"].build(SimTokenizer(), 0)
    docs = sorted(offsets[i] for i, r in enumerate(reqs) if r.class_name == "document")
    for d in docs:
        assert any(r.class_name == "chat" and d < offsets[i] < d + 1.0 for i, r in enumerate(reqs))
    caps = [Candidate.parse(c).overrides for c in SCENARIOS["long-prompts"].configs]
    assert any(o.get("long_prefill_token_threshold") for o in caps)
    assert any(o.get("policy") == "chunked" and not o.get("long_prefill_token_threshold") for o in caps)


def test_itl_target_is_two_loads_with_two_targets_and_fixed_budgets():
    sc = SCENARIOS["itl-target"]
    assert set(sc.loads) == {"sharegpt-bursty", "long-prompts"} and all(SCENARIOS[x].build for x in sc.loads)
    with pytest.raises(ValueError, match="scenario: 'itl-target' is several loads"):
        scenario_requests("itl-target", None, SimTokenizer(), 0)
    parsed = [Candidate.parse(c).overrides for c in sc.configs]
    assert sorted(o["target_itl_ms"] for o in parsed if o.get("target_itl_ms")) == [50, 150]
    assert len({o["max_num_batched_tokens"] for o in parsed if o.get("itl_target_factor") == 0}) >= 3
    assert {"policy": "chunked"} in parsed  # the no-flag default beside them


def test_every_scenario_configuration_parses_against_the_real_config():
    for sc in SCENARIOS.values():
        for c in sc.configs:
            Candidate.parse(c)
    c = Candidate.parse("policy=chunked,target_itl_ms=150,target_ttft_ms=3000,fairness=vtc")
    assert c.overrides == {"policy": "chunked", "target_itl_ms": 150.0, "target_ttft_ms": 3000.0, "fairness": "vtc"}


# --- configuration keys ---------------------------------------------------------------------------

def test_keys_are_read_as_their_field_type():
    assert parse_overrides("max_num_batched_tokens=128,policy=chunked") == {"max_num_batched_tokens": 128,
                                                                          "policy": "chunked"}
    o = parse_overrides("target_itl_ms=150.5,fairness=vtc,target_ttft_ms=none")
    assert o == {"target_itl_ms": 150.5, "fairness": "vtc", "target_ttft_ms": None}
    assert isinstance(parse_value("target_itl_ms", "150"), float)
    for bad, field in (("max_num_batched_tokens=12.5", "max_num_batched_tokens"),
                       ("target_itl_ms=fast", "target_itl_ms"), ("target_itl_ms=nan", "target_itl_ms"),
                       ("fairness=lottery", "fairness")):
        with pytest.raises(ValueError, match=field):
            parse_overrides(bad)
    c = Candidate.parse("policy=chunked,max_num_batched_tokens=2048,target_itl_ms=150,fairness=vtc",
                        )
    assert c.name == "chunked itl<=150ms chunk=2048 vtc"


# --- the frontier plot ----------------------------------------------------------------------------

def _ev(name: str, overrides: dict, itl: float, ttft: float) -> Evaluation:
    return Evaluation(Candidate(name, overrides), {"p99_itl_ms": itl, "p99_ttft_ms": ttft}, None, [], 0)


def test_frontier_verdict_compares_the_target_with_budgets_that_meet_it(tmp_path):
    evs = [_ev("target", {"max_num_batched_tokens": 2048, "target_itl_ms": 150.0}, 140, 900),
           _ev("b64", {"max_num_batched_tokens": 64, "itl_target_factor": 0}, 80, 4000),
           _ev("b128", {"max_num_batched_tokens": 128, "itl_target_factor": 0}, 145, 1500),
           _ev("b512", {"max_num_batched_tokens": 512, "itl_target_factor": 0}, 480, 700),
           # the default target steers its prefill too: not a fixed budget the target is judged against
           _ev("default", {"policy": "chunked"}, 120, 800)]
    assert frontier.wanted(evs) and frontier.targets(evs) == [150.0]
    assert [frontier.fixed(e) for e in evs] == [False, True, True, True, False]
    assert frontier.default_target(evs[4]) and not frontier.default_target(evs[0])
    assert frontier.fixed(_ev("pf", {"policy": "prefill-first"}, 1, 1))
    (line,) = frontier.verdict(evs)
    assert "ITL p99 140 ms (meets the target)" in line and "2 fixed budget(s) meet it" in line
    assert "1,500 ms (b128)" in line and "lower than every one" in line
    evs[0] = _ev("target", {"max_num_batched_tokens": 2048, "target_itl_ms": 150.0}, 160, 1600)
    assert "misses the target" in frontier.verdict(evs)[0] and "not lower than all" in frontier.verdict(evs)[0]
    frontier.plot_frontier(evs, tmp_path / frontier.PLOT)
    assert (tmp_path / frontier.PLOT).stat().st_size > 0
    assert not frontier.wanted([evs[1], _ev("again", {"max_num_batched_tokens": 64, "itl_target_factor": 0}, 80, 4000)])


def test_compare_writes_the_frontier_and_the_per_class_table(tmp_path):
    configs = ["policy=chunked,max_num_batched_tokens=64", "policy=chunked,max_num_batched_tokens=512",
               "capped:policy=chunked,max_num_batched_tokens=512,long_prefill_token_threshold=256,"
               "max_long_partial_prefills=1"]
    run_compare("long-prompts", None, configs, EngineConfig(), str(tmp_path), evaluator=SimEvaluator())
    assert (tmp_path / frontier.PLOT).stat().st_size > 0
    md = (tmp_path / "compare.md").read_text()
    assert "## Per class" in md and "| chat | capped |" in md and f"![{frontier.PLOT}]" in md
    data = json.loads((tmp_path / "compare.json").read_text())
    chat = {c: per["chat"]["p99_ttft_ms"] for c, per in data["per_class"].items()}
    # in the simulator the cap lets the chats behind a document start sooner
    assert chat["capped"] < chat["chunked chunk=512"]


def test_compare_runs_each_load_of_a_several_load_scenario(tmp_path):
    configs = ["policy=chunked,max_num_batched_tokens=64", "policy=chunked,max_num_batched_tokens=256"]
    out = run_compare("itl-target", None, configs, EngineConfig(), str(tmp_path), evaluator=SimEvaluator())
    assert set(out["loads"]) == {"sharegpt-bursty", "long-prompts"}
    for load in out["loads"]:
        assert (tmp_path / load / frontier.PLOT).stat().st_size > 0
    index = (tmp_path / "compare.md").read_text()
    assert "(sharegpt-bursty/compare.md)" in index and "(long-prompts/compare.md)" in index


# --- tune: a target instead of a budget ---------------------------------------------------------

def _fake_measure(o: dict) -> dict:
    """A target T gives ITL p99 1.1 T; a budget B gives 10 + B; goodput grows with both, targets more."""
    t = o.get("target_itl_ms")
    itl = 1.1 * t if t else 10 + o["max_num_batched_tokens"]
    goodput = t / 50 if t else o["max_num_batched_tokens"] / 100
    return {"output_throughput": 100 * goodput, "total_token_throughput": 100 * goodput, "request_goodput": goodput,
            "median_ttft_ms": 1000 / goodput, "p99_ttft_ms": 2000 / goodput, "median_itl_ms": itl / 2,
            "p99_itl_ms": itl, "p99_stall_ms": itl, "completed": 10, "failed": 0}


def test_tune_tries_targets_from_the_slo_and_recommends_one(tmp_path):
    cfg = TuneConfig(slo_itl_ms=150, slo_ttft_ms=60_000)
    targets = cfg.targets()
    assert targets == [75.0, 90.0, 105.0, 120.0, 135.0, 150.0]
    assert TuneConfig(slo_ttft_ms=1000).targets() == []  # no ITL SLO: nothing to derive targets from
    slo = SLO(ttft_p99_ms=60_000, itl_p99_ms=150)
    result = tune(_fake_measure, slo, chunks=(32, 64, 128, 256), seqs=(8, 16), repeats=1, max_trials=12,
                  targets=targets, fixed={"fairness": "vtc"})
    tried = sorted(t.overrides["target_itl_ms"] for t in result.trials if t.overrides.get("target_itl_ms"))
    assert tried == targets  # the budget search left room for every target
    assert result.feasible and result.best.overrides["target_itl_ms"] == 135.0  # 150 gives ITL 165: a miss
    assert all(t.overrides["fairness"] == "vtc" for t in result.trials)
    assert "--target-itl-ms 135 " in result.command and "--fairness vtc" in result.command
    kinds = best_by_kind(result, slo)
    assert kinds["budget"].overrides["max_num_batched_tokens"] == 128  # 256 + 10 > 150
    write_tune_report(tmp_path, result, slo, {"workload": "fake"})
    md = (tmp_path / "tune.md").read_text()
    assert "## A budget or an ITL target" in md and "Recommended: **an ITL target**" in md
    assert json.loads((tmp_path / "tune.json").read_text())["recommends"] == "target"


def test_tune_target_search_on_the_simulator_meets_the_itl_slo():
    reqs = [BenchRequest(i, "chat", " ".join(f"c{i}w{j}" for j in range(32)), 32, 64) for i in range(8)]
    reqs += [BenchRequest(8 + i, "doc", " ".join(f"d{i}w{j}" for j in range(2000)), 2000, 8) for i in range(4)]
    offsets = [0.0] * 8 + [0.2, 0.6, 1.0, 1.4]

    def measure(overrides):
        from tandem.bench.evaluate import evaluate

        return evaluate(SimEvaluator(), Candidate("t", overrides), reqs, offsets, [50, 99],
                        {"ttft": 30.0, "tpot": 0.150}, 600).summary

    slo = SLO(ttft_p99_ms=30_000, itl_p99_ms=150)
    targets = TuneConfig(slo_itl_ms=150, slo_ttft_ms=30_000).targets()
    result = tune(measure, slo, chunks=(64, 128, 256, 1024), seqs=(16,), repeats=1, targets=targets)
    best_target = best_by_kind(result, slo)["target"]
    assert best_target.summary["p99_itl_ms"] <= 150
    assert best_target.overrides["target_itl_ms"] in targets
