"""Fair sharing between users (VTC) on the torch-free core: the simulator's virtual clock and
step-cost runner, counters and admission order checked against hand-worked examples."""

from __future__ import annotations

import random
import re

import pytest

from tandem.config import FAIRNESS, SchedulerConfig
from tandem.core.fairness import FAIRNESS_REGISTRY, VTC
from tandem.core.request import SamplingParams
from tandem.latency import summarize
from tandem.sim import StepCost, sim_engine

PROMPT = list(range(1, 11))  # 10 tokens


def engine_for(fairness="vtc", max_num_seqs=1, **sched):
    return sim_engine(SchedulerConfig(fairness=fairness, max_num_seqs=max_num_seqs, **sched), StepCost())


def add(engine, rid, user, max_tokens=2, priority=0, prompt=PROMPT):
    engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), request_id=rid,
                       priority=priority, user=user)
    engine.added = getattr(engine, "added", []) + [engine.scheduler.requests[rid]]


def run(engine, until=None):
    """Step to the end (or until ``until()`` holds); returns the ids of the requests first
    scheduled meanwhile, in the order they were first scheduled."""
    known = {r.request_id for r in getattr(engine, "added", []) if r.timing.first_scheduled is not None}
    while engine.has_unfinished_requests() and not (until and until()):
        engine.step()
        engine.scheduler.check_invariants()
    started = [r for r in engine.added if r.timing.first_scheduled is not None and r.request_id not in known]
    return [r.request_id for r in sorted(started, key=lambda r: r.timing.first_scheduled)]


def test_registry_is_the_cli_choice_list():
    assert tuple(FAIRNESS_REGISTRY) == FAIRNESS == ("fcfs", "vtc")
    assert SchedulerConfig().fairness == "fcfs"
    with pytest.raises(ValueError, match="^fairness:"):
        SchedulerConfig(fairness="lottery").validate()
    with pytest.raises(ValueError, match="^vtc_decode_weight:"):
        SchedulerConfig(vtc_decode_weight=-1.0).validate()


def test_counters_and_order_hand_worked():
    # One seat. Each request: 10 prompt tokens (weight 1) and 2 sampled tokens (weight 2) = 14.
    # A sends a0 a1 a2, then B sends b0, all at t=0. a0 goes first (tie at 0, earlier arrival);
    # then B (0) < A (14): b0; then A and B tie at 14 and a1 arrived before b0's user had more:
    # a1, then a2 (B has nothing left). FCFS would run a0 a1 a2 b0.
    for fairness, expected in (("vtc", ["a0", "b0", "a1", "a2"]), ("fcfs", ["a0", "a1", "a2", "b0"])):
        engine = engine_for(fairness)
        for rid in ("a0", "a1", "a2"):
            add(engine, rid, "A")
        add(engine, "b0", "B")
        assert run(engine) == expected, fairness
    assert engine_for("vtc").scheduler.fairness.counters == {}
    engine = engine_for("vtc")
    for rid in ("a0", "a1", "a2"):
        add(engine, rid, "A")
    add(engine, "b0", "B")
    run(engine)
    assert engine.scheduler.fairness.counters == {"A": 42.0, "B": 14.0}


def test_weights_are_config_fields():
    engine = engine_for("vtc", vtc_prefill_weight=0.5, vtc_decode_weight=3.0)
    add(engine, "a0", "A", max_tokens=4)
    run(engine)
    assert engine.scheduler.fairness.counters == {"A": 0.5 * 10 + 3.0 * 4}


def test_one_step_admissions_are_shared_out():
    # Many seats, one step admits several: the projected order alternates users rather than
    # letting the user with the lowest counter take every seat of the step.
    engine = engine_for("vtc", max_num_seqs=8)
    for i in range(4):
        add(engine, f"a{i}", "A")
    for i in range(2):
        add(engine, f"b{i}", "B")
    order = engine.scheduler.queues.admission_order()
    assert [r.request_id for r in order] == ["a0", "b0", "a1", "b1", "a2", "a3"]
    run(engine)


def test_returning_user_gets_no_banked_credit():
    # A runs alone and earns 14 per request. After three, B arrives with three requests: B starts
    # at A's counter (42), not at 0, so it interleaves with A instead of running all three first.
    engine = engine_for("vtc")
    for i in range(5):
        add(engine, f"a{i}", "A")
    vtc: VTC = engine.scheduler.fairness
    run(engine, until=lambda: len(engine.scheduler.waiting) == 2 and not engine.scheduler.running)
    assert vtc.counters == {"A": 42.0}
    for i in range(3):
        add(engine, f"b{i}", "B")
    assert vtc.counters["B"] == 42.0
    # tie at 42: a3 arrived first; then B (42) < A (56): b0; tie at 56: a4 (arrived first); b1, b2
    assert run(engine) == ["a3", "b0", "a4", "b1", "b2"]

    # B left last, at 84: that is the floor. A returns (its own 70 is below) and starts at 84, runs
    # three more (126) and leaves. Now B returns to an idle engine: it starts at the floor A left,
    # 126, not at its own 84 — the time it spent idle is not credit.
    assert vtc.counters == {"A": 70.0, "B": 84.0}
    for i in range(3):
        add(engine, f"c{i}", "A")
    assert vtc.counters["A"] == 84.0
    run(engine)
    assert vtc.counters == {"A": 126.0, "B": 84.0}
    add(engine, "a-next", "A")
    add(engine, "b-next", "B")
    assert vtc.counters == {"A": 126.0, "B": 126.0}
    assert run(engine) == ["a-next", "b-next"]


def test_floor_lifts_a_returning_user_with_little_history():
    engine = engine_for("vtc")
    vtc: VTC = engine.scheduler.fairness
    add(engine, "b0", "B")
    run(engine)
    for i in range(4):
        add(engine, f"a{i}", "A")
    run(engine, until=lambda: vtc.counters["A"] >= 42.0 and not engine.scheduler.running)
    add(engine, "b1", "B")
    assert vtc.counters["B"] == vtc.counters["A"] > 14.0
    run(engine)


def test_priorities_rank_before_fairness():
    # A's low-priority request waits while B's run, so A's counter stays 0 and B's reaches 28.
    # B's priority -1 request still goes first; within priority 0 fairness puts A's two ahead of
    # B's b2; the priority 1 request comes last.
    engine = engine_for("vtc")
    add(engine, "a-low", "A", priority=1)
    for i in range(3):
        add(engine, f"b{i}", "B")
    vtc = engine.scheduler.fairness
    run(engine, until=lambda: vtc.counters["B"] >= 28.0 and not engine.scheduler.running)
    assert vtc.counters == {"A": 0.0, "B": 28.0}
    add(engine, "a0", "A")
    add(engine, "a1", "A")
    add(engine, "b-urgent", "B", priority=-1)
    expected = ["b-urgent", "a0", "a1", "b2", "a-low"]
    assert [r.request_id for r in engine.scheduler.queues.admission_order()] == expected
    assert run(engine) == expected


def test_invariants_hold_under_preemption_with_many_users():
    rng = random.Random(3)
    engine = sim_engine(SchedulerConfig(fairness="vtc", max_num_seqs=6, max_num_batched_tokens=32), StepCost(),
                        num_kv_blocks=24, block_size=4)
    finished = set()
    for i in range(30):
        prompt = [rng.randrange(1, 900) for _ in range(rng.randint(1, 40))]
        add(engine, f"r{i}", f"u{rng.randrange(5)}", max_tokens=rng.randint(1, 40),
            priority=rng.choice([0, 0, 1]), prompt=prompt)
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished.add(out.request_id)
        engine.scheduler.check_invariants()
        steps += 1
        assert steps < 20_000
    assert len(finished) == 30
    assert engine.scheduler.num_preemptions > 0, "the example should exercise preemption"
    assert engine.allocator.all_free()
    assert engine.scheduler.fairness._live == {} and engine.scheduler.fairness._admitted == {}


def _power_user_ttfts(fairness: str) -> tuple[list[float], list[float], float]:
    """One power user bursts 40 requests every 4 s; three light users send one every ~1.5 s.
    Returns light users' TTFTs, the power user's, and output tokens per second."""
    rng = random.Random(7)
    arrivals = []
    for burst in range(3):
        arrivals += [(4.0 * burst, "power")] * 40
    for user in ("l1", "l2", "l3"):
        t = rng.uniform(0, 1)
        while t < 12:
            arrivals.append((t, user))
            t += rng.uniform(1.0, 2.0)
    arrivals.sort(key=lambda a: a[0])
    engine = sim_engine(SchedulerConfig(fairness=fairness, max_num_seqs=8, max_num_batched_tokens=256),
                        StepCost(base=0.010, per_token=0.0005, per_seq=0.0002))
    clock = engine.clock
    ttft: dict[str, list[float]] = {"power": [], "light": []}
    tokens = 0
    i = 0
    while i < len(arrivals) or engine.has_unfinished_requests():
        while i < len(arrivals) and arrivals[i][0] <= clock():
            t, user = arrivals[i]
            engine.add_request(list(range(1, 129)), SamplingParams(max_tokens=32, ignore_eos=True),
                               request_id=f"q{i}", arrival_time=t, user=user)
            i += 1
        if not engine.has_unfinished_requests():
            clock.advance_to(arrivals[i][0])
            continue
        for out in engine.step():
            if out.finished:
                tokens += len(out.token_ids)
                ttft["power" if out.user == "power" else "light"].append(out.timing.ttft)
    return ttft["light"], ttft["power"], tokens / clock()


def test_power_user_does_not_starve_light_users():
    light_fcfs, _, tput_fcfs = _power_user_ttfts("fcfs")
    light_vtc, power_vtc, tput_vtc = _power_user_ttfts("vtc")
    p99_fcfs = summarize(light_fcfs, [99])["p99"]
    p99_vtc = summarize(light_vtc, [99])["p99"]
    assert p99_fcfs > 5 * p99_vtc, (p99_fcfs, p99_vtc)
    assert abs(tput_vtc - tput_fcfs) / tput_fcfs < 0.05
    assert len(power_vtc) == 120


def test_vtc_victim_is_the_latest_admitted_not_the_latest_arrived():
    # p arrived first but fairness admitted l first: under VTC p ranks below l (work admitted
    # earlier is never preempted for work admitted later); FCFS ranks by arrival instead.
    from tandem.core.budget import StepBudget
    from tandem.core.kv_blocks import BlockAllocator
    from tandem.core.queues import RequestQueues
    from tandem.core.request import Request
    from tandem.core.step import KVLayout

    for fairness, victim in (("vtc", "p"), ("fcfs", None)):
        queues = RequestQueues(FAIRNESS_REGISTRY[fairness](SchedulerConfig()))
        p, l = (Request(rid, PROMPT, SamplingParams(), 0.0, 64, user=rid) for rid in ("p", "l"))
        p.arrival_index, l.arrival_index = 0, 1
        for r in (p, l):
            queues.add(r)
        queues.start(l)
        queues.start(p)
        budget = StepBudget(64, 4, BlockAllocator(KVLayout(8, 4)), queues, 1)
        assert getattr(budget._pick_victim(exclude=l), "request_id", None) == victim, fairness
        assert [r.request_id for r in queues.ranked_running()] == (["l", "p"] if fairness == "vtc" else ["p", "l"])


# --- the server: who the user is, and per-user metrics ------------------------------------------


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    from server_helpers import InProcessApp
    from tandem.config import EngineConfig, ServerConfig
    from tandem.server.state import build_state
    from tiny_models import save_tiny

    d = tmp_path_factory.mktemp("fair-model")
    save_tiny("llama", d)
    config = EngineConfig.from_kwargs(model=str(d), dtype="float32", num_kv_blocks=128, block_size=4,
                                      max_num_seqs=4, fairness="vtc")
    state = build_state(config, ServerConfig(peak_flops=1e11, peak_memory_bandwidth=1e10, metrics_top_users=2))
    a = InProcessApp(state)
    yield a
    a.close()


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("body_user, header", [("", None), ("x" * 257, None), ("tab\there", None), (7, None),
                                               (None, ""), ("ok", "x" * 300), (None, "bell\x07")])
def test_bad_user_is_a_400_naming_user(app, route, body_user, header):
    from server_helpers import assert_error

    body = {"prompt": "hello", "max_tokens": 1} if "chat" not in route else {
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    if body_user is not None:
        body["user"] = body_user
    headers = {"X-Tandem-User": header} if header is not None else {}
    err = assert_error(app.call("POST", route, json=body, headers=headers), 400)
    assert err["param"] == "user", err


def test_user_from_header_or_body_reaches_metrics(app):
    def send(user=None, header=None, n=1):
        body = {"prompt": "hello world", "max_tokens": 2, "ignore_eos": True, "n": n}
        if user is not None:
            body["user"] = user
        r = app.call("POST", "/v1/completions", json=body,
                     headers={"X-Tandem-User": header} if header is not None else {})
        assert r.status_code == 200, r.text

    send(user="alice", n=3)
    send(user="mallory", header="bob", n=2)  # the gateway's header wins over the body
    send()  # anonymous
    text = app.call("GET", "/metrics").text
    series = {(m["name"], m["user"]): float(m["value"]) for m in
              re.finditer(r'^(?P<name>tandem:user_\w+)\{.*user="(?P<user>[^"]*)"\} (?P<value>\S+)$', text, re.M)}
    # top 2 by tokens: alice (3 requests), bob (2); anonymous is the rest
    assert series["tandem:user_requests_total", "alice"] == 3
    assert series["tandem:user_requests_total", "bob"] == 2
    assert series["tandem:user_requests_total", "other"] == 1
    assert series["tandem:user_generation_tokens_total", "alice"] == 6
    assert series["tandem:user_vtc_counter", "bob"] > 0
    assert {u for _, u in series} == {"alice", "bob", "other"}
    counters = app.state.engine.scheduler.fairness.counters
    assert counters["bob"] > 0 and "mallory" not in counters and "" in counters


def test_per_user_labels_stay_bounded():
    from prometheus_client import generate_latest

    from tandem.core.outputs import RequestOutput
    from tandem.core.request import RequestTiming
    from tandem.server.prometheus import ServerMetrics
    from tandem.utilization import Peaks

    metrics = ServerMetrics("m", None, Peaks(1e9, 1e9, measured=False), top_users=10)
    for i in range(100):
        out = RequestOutput(f"r{i}", None, [1] * (i + 1), "", [2] * 3, "", [], True, "length",
                            RequestTiming(arrival=0.0), user=f"user-{i:03d}")
        metrics.on_finish(out)
    text = generate_latest(metrics.registry).decode()
    users = {line.split('user="')[1].split('"')[0] for line in text.splitlines()
             if line.startswith("tandem:user_prompt_tokens_total")}
    assert len(users) == 11 and "other" in users
    assert users - {"other"} == {f"user-{i:03d}" for i in range(90, 100)}  # the most tokens
    total = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                if line.startswith("tandem:user_prompt_tokens_total"))
    assert total == sum(range(1, 101))  # nothing lost in the aggregate

    # the totals kept are bounded too: beyond `tracked` users the smaller half folds into other
    metrics.users.tracked = 20
    for i in range(100, 200):
        metrics.on_finish(RequestOutput(f"r{i}", None, [1], "", [2], "", [], True, "length",
                                        RequestTiming(arrival=0.0), user=f"user-{i:03d}"))
    assert len(metrics.users._totals) <= 20
    rows = metrics.users.rows()
    assert len(rows) == 11 and sum(r[0] for r in rows.values()) == 200
