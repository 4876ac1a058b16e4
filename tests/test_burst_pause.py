"""The chunked policy's burst pause (``tandem.core.burst_pause``), on the simulator: waves of prompts
in a closed loop prefill whole while the streams wait, each stream sees at most one long gap per
wave and the long gaps stay within the overrun allowance; no pause where the requests promise no
gaps, where fewer prompts wait than streams run, or past ``max_pause_ms``; and the ledger's and
the request's arithmetic."""

import dataclasses
import random

from tandem.config import SchedulerConfig
from tandem.core.gap_ledgers import OverrunLedger
from tandem.core.request import Request, SamplingParams
from tandem.core.step_time import StepCost
from tandem.sim import sim_engine

# a 2-core CPU's shape: a 16-stream decode step ~25 ms, a 512-token prompt step ~0.35 s
COST = StepCost(base=0.015, per_token=0.00065, per_seq=0.0003, per_context=2e-7)
PAUSE_OFF = {"max_pause_ms": 0.0}


def ids(n: int, start: int) -> list[int]:
    return [1 + (start + i) % 998 for i in range(n)]


def closed_loop(config: SchedulerConfig, n: int = 32, c: int = 16, prompt: int = 256, out: int = 128, **params):
    """``n`` requests, at most ``c`` in flight: each one that ends is replaced at once, as a
    closed-loop load generator does. Returns the engine and the requests' timings."""
    engine = sim_engine(config, COST, num_kv_blocks=4096, block_size=16)
    timings = {}

    def send(i: int) -> None:
        rid = engine.add_request(ids(prompt, start=37 * i), SamplingParams(max_tokens=out, **params))
        timings[rid] = engine.scheduler.requests[rid].timing

    sent = min(c, n)
    for i in range(sent):
        send(i)
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished and sent < n:
                send(sent)
                sent += 1
        engine.scheduler.check_invariants()
    assert engine.allocator.all_free()
    return engine, list(timings.values())


def gaps(timings):
    return [g for t in timings for g in t.itls]


def p99(values):
    values = sorted(values)
    return values[min(len(values) - 1, int(0.99 * len(values)))]


def pause_steps(engine):
    return [s for s in engine.step_stats if s.sizing is not None and s.sizing.limit == "pause"]


def pause_ends(engine):
    """Each pause's end as the step after it reports it: (that step's id, why)."""
    return [(s.step_id, s.sizing.pause_end) for s in engine.step_stats if s.sizing is not None and s.sizing.pause_end]


def runs_of(steps):
    """Consecutive paused steps, one list per pause."""
    runs, current = [], [steps[0]]
    for prev, s in zip(steps, steps[1:]):
        if s.step_id == prev.step_id + 1:
            current.append(s)
        else:
            runs.append(current)
            current = [s]
    return [*runs, current]


def test_waves_prefill_whole_while_streams_wait_one_long_gap_each():
    config = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=512)
    paused, timings = closed_loop(config, ignore_eos=True)
    spread, spread_timings = closed_loop(dataclasses.replace(config, **PAUSE_OFF), ignore_eos=True)
    steps = pause_steps(paused)
    assert steps and all(s.num_decode_tokens == 0 and s.num_prefill_tokens > 0 for s in steps)
    assert all(s.sizing.paused > 0 and s.sizing.target_seconds > 0 for s in steps)
    assert not pause_steps(spread)
    # every pause ends when its wave's prompts are done, and the step after it says so
    assert pause_ends(paused) == [(run[-1].step_id + 1, "done") for run in runs_of(steps)]
    assert not pause_ends(spread)
    # a pause is one long gap per stream: within the overrun allowance of all gaps
    targets = [s.sizing.target_seconds for s in steps]
    t = min(targets)
    long_gaps = [g for g in gaps(timings) if g > t]
    assert 0 < len(long_gaps) <= config.itl_overrun_share * len(gaps(timings))
    for timing in timings:  # at most one long gap per wave (two waves here)
        assert sum(g > t for g in timing.itls) <= 2
    # and at the p99 the gaps stay within the target, as the prompts finish sooner and the streams,
    # started together, decode in full batches
    assert p99(gaps(timings)) <= max(targets)
    assert p99([x.ttft for x in timings]) < p99([x.ttft for x in spread_timings])
    assert paused.clock.now < spread.clock.now


def test_no_pause_where_the_requests_promise_no_gaps_and_none_were_seen():
    # without ignore_eos nothing says a stream will run long: at a load's start (no gaps seen) no
    # pause is paid for; min_tokens promises gaps, and then waves pause again
    engine, _ = closed_loop(SchedulerConfig(max_num_seqs=16), n=16)
    assert not pause_steps(engine)
    engine, _ = closed_loop(SchedulerConfig(max_num_seqs=16), n=16, min_tokens=128)
    assert pause_steps(engine)


def test_no_pause_for_fewer_prompts_than_streams():
    # 16 streams in flight; one prompt arrives at a time as one ends: it may not stall the 15 others
    config = SchedulerConfig(max_num_seqs=16)
    engine = sim_engine(config, COST, num_kv_blocks=4096, block_size=16)
    for i in range(15):
        engine.add_request(ids(64, 37 * i), SamplingParams(max_tokens=400, ignore_eos=True))
    for _ in range(10):
        engine.step()
    engine.add_request(ids(256, 999), SamplingParams(max_tokens=400, ignore_eos=True))
    for _ in range(10):
        engine.step()
    assert not pause_steps(engine)


def test_a_pause_ends_at_max_pause_ms():
    # long prompts: a wave's prefill takes seconds; the pause stops at the first step past its limit
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512, max_pause_ms=1000.0)
    engine, _ = closed_loop(config, n=8, c=8, prompt=1500, out=400, ignore_eos=True)
    steps = pause_steps(engine)
    assert steps
    runs = runs_of(steps)
    # every pause but the last wave's stops at the limit, with prompt work left
    ends = dict(pause_ends(engine))
    assert [ends[run[-1].step_id + 1] for run in runs[:-1]] == ["time"] * (len(runs) - 1)
    assert runs[:-1]
    for run in runs:
        # each step of a run began within the limit of the run's first
        assert run[-1].start - run[0].start < 1.0
    # between two pauses the streams decode at least one step
    paused_ids = {s.step_id for s in steps}
    for run in runs[1:]:
        assert run[0].step_id - 1 not in paused_ids


def test_a_pause_starts_only_prompts_whose_streams_keep_decode_steps_within_the_target():
    # eight long streams, then long prompts (1-3k tokens) arriving while they decode, a tight
    # explicit target: with every waiting prompt started in a pause, 15 streams at 2k-token
    # contexts would take longer than T on every step after it
    cost = StepCost(base=0.010, per_token=0.0004, per_seq=0.0002, per_context=1e-6, per_pair=2e-9)
    config = SchedulerConfig(max_num_batched_tokens=2048, target_itl_ms=40.0, itl_overrun_share=0.005)
    engine = sim_engine(config, cost, num_kv_blocks=4096, block_size=16, prior=cost)
    rng = random.Random(0)
    arrivals = [(0.0, rng.randint(50, 200), 300) for _ in range(8)]
    arrivals += [(0.2 + 0.25 * i, rng.randint(1000, 3000), 20) for i in range(12)]
    timings = []
    while arrivals or engine.has_unfinished_requests():
        while arrivals and arrivals[0][0] <= engine.clock.now:
            t, prompt, out = arrivals.pop(0)
            rid = engine.add_request(ids(prompt, start=len(timings) * 37 + int(t * 1000)),
                                     SamplingParams(max_tokens=out, ignore_eos=True), arrival_time=t)
            timings.append(engine.scheduler.requests[rid].timing)
        if not engine.has_unfinished_requests():
            engine.clock.advance_to(arrivals[0][0])
            continue
        engine.step()
    assert pause_steps(engine)
    # the pause stopped because the next prompt would not fit, not for want of prompts
    assert [why for _, why in pause_ends(engine)] == ["gate"]
    all_gaps = gaps(timings)
    assert sum(g > 0.040 + 1e-9 for g in all_gaps) <= 0.005 * len(all_gaps) + 8
    assert p99(all_gaps) <= 0.040 * 1.02


def test_ledger_pays_long_gaps_from_seen_and_guaranteed_gaps():
    ledger = OverrunLedger(0.01)
    assert not ledger.allows_long_gaps(1, 0)  # nothing seen, nothing promised
    assert ledger.allows_long_gaps(16, 16 * 127 - 400) and not ledger.allows_long_gaps(16, 1000)
    ledger.charge(16)
    assert ledger.over == 16 and ledger.gaps == 0
    for _ in range(100):
        ledger.record(16, 0.02, 0.05)
    assert ledger.gaps == 1600 and ledger.over == 16
    assert not ledger.allows_long_gaps(1, 0) and ledger.allows_long_gaps(1, 100)
    assert not OverrunLedger(0.0).allows_long_gaps(1, 10**6)
    # steps over T by noise use up the overrun allowance, not the pauses' share of long gaps
    noisy = OverrunLedger(0.01)
    for _ in range(100):
        noisy.record(16, 0.06, 0.05)
    assert noisy.over == 1600 and not noisy.allows(16) and noisy.allows_long_gaps(16, 0)
    noisy.charge(16)
    assert noisy.over == 1616 and not noisy.allows_long_gaps(1, 0)


def test_guaranteed_output_tokens():
    def req(prompt=10, max_total=100, **params):
        return Request("r", list(range(prompt)), SamplingParams(**params), 0.0, max_total)

    assert req(max_tokens=50).guaranteed_output_tokens == 0
    assert req(max_tokens=50, min_tokens=5).guaranteed_output_tokens == 5
    assert req(max_tokens=50, ignore_eos=True).guaranteed_output_tokens == 50
    assert req(max_tokens=500, ignore_eos=True).guaranteed_output_tokens == 90  # the context's room
    assert req(max_tokens=50, ignore_eos=True, stop=["x"]).guaranteed_output_tokens == 0
    assert req(max_tokens=50, ignore_eos=True, stop_token_ids=[3], min_tokens=2).guaranteed_output_tokens == 2
    r = req(max_tokens=50, ignore_eos=True)
    assert r.guaranteed_gaps_left == 49
    r.output_token_ids = [1] * 10
    assert r.guaranteed_gaps_left == 40
