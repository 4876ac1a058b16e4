"""The scheduling core on its own: no torch, a fake runner, a virtual clock."""

from __future__ import annotations

import itertools
import random

import pytest

from fakes import ByteTokenizer, SlotRunner
from tandem.config import SchedulerConfig
from tandem.core.engine import Engine
from tandem.core.policies import POLICY_REGISTRY
from tandem.core.request import SamplingParams
from tandem.core.step import KVLayout
from tandem.config import POLICIES


class VirtualClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        self.t += 0.001
        return self.t


def make_engine(policy="chunked", num_blocks=256, block_size=4, max_model_len=512, **sched):
    config = SchedulerConfig(policy=policy, **sched)
    layout = KVLayout(num_blocks, block_size)
    runner = SlotRunner(layout)
    engine = Engine(config, runner, ByteTokenizer(), layout, max_model_len, clock=VirtualClock())
    return engine, runner


def run_all(engine: Engine, check=True):
    finished = {}
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        if check:
            engine.scheduler.check_invariants()
        steps += 1
        assert steps < 100_000, "engine made no progress"
    assert engine.allocator.all_free(), "blocks leaked"
    engine.allocator.check_invariants()
    return finished


def workload(seed=0, n=12):
    rng = random.Random(seed)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(1, 60))] for _ in range(n)]
    max_tokens = [rng.randint(1, 30) for _ in range(n)]
    return prompts, max_tokens


def reference_outputs(prompts, max_tokens):
    """Each request alone, one at a time: the answer every batching must reproduce."""
    outs = []
    for p, m in zip(prompts, max_tokens):
        engine, _ = make_engine("prefill-first")
        engine.add_request(p, SamplingParams(max_tokens=m, ignore_eos=True))
        (out,) = run_all(engine).values()
        outs.append(out.token_ids)
    return outs


def submit(engine, prompts, max_tokens):
    return [
        engine.add_request(p, SamplingParams(max_tokens=m, ignore_eos=True), request_id=f"r{i}")
        for i, (p, m) in enumerate(zip(prompts, max_tokens))
    ]


def test_policy_registry_matches_config_choices():
    assert tuple(POLICY_REGISTRY) == POLICIES


CONFIGS = [
    dict(policy="static", max_num_seqs=4, max_num_batched_tokens=64),
    dict(policy="static", max_num_seqs=16, max_num_batched_tokens=1024),
    dict(policy="prefill-first", max_num_seqs=3, max_num_batched_tokens=64),
    dict(policy="prefill-first", max_num_seqs=32, max_num_batched_tokens=2048),
    dict(policy="chunked", max_num_seqs=4, max_num_batched_tokens=7),
    dict(policy="chunked", max_num_seqs=8, max_num_batched_tokens=16),
    dict(policy="chunked", max_num_seqs=32, max_num_batched_tokens=128),
    dict(policy="chunked", max_num_seqs=8, max_num_batched_tokens=32, long_prefill_token_threshold=8,
         max_long_partial_prefills=1),
]


@pytest.mark.parametrize("num_blocks", [256, 24])  # 24 blocks of 4 forces preemption
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: "-".join(str(v) for v in c.values()))
def test_outputs_independent_of_batching(cfg, num_blocks):
    prompts, max_tokens = workload()
    expected = reference_outputs(prompts, max_tokens)
    engine, runner = make_engine(num_blocks=num_blocks, **cfg)
    submit(engine, prompts, max_tokens)
    done = run_all(engine)
    assert [done[f"r{i}"].token_ids for i in range(len(prompts))] == expected
    for out in runner.steps:
        assert len(out.chunks) <= cfg["max_num_seqs"]
    if num_blocks == 24 and cfg["policy"] != "static":
        assert engine.scheduler.num_preemptions > 0


def test_chunked_respects_budget_and_puts_decodes_first():
    prompts, max_tokens = workload(seed=3, n=10)
    engine, runner = make_engine("chunked", max_num_seqs=16, max_num_batched_tokens=16)
    submit(engine, prompts, max_tokens)
    run_all(engine)
    saw_mixed = False
    for out in runner.steps:
        assert out.num_tokens <= 16
        kinds = [c.is_decode for c in out.chunks]
        # decodes form a prefix of the step: no prompt chunk is placed before a decode
        assert kinds == sorted(kinds, reverse=True)
        saw_mixed |= out.kind == "mixed"
    assert saw_mixed
    # a 60-token prompt cannot fit one 16-token step: it was split into chunks
    assert any(c.num_tokens < c.num_prompt_tokens and not c.samples for o in runner.steps for c in o.chunks)


def test_long_prefill_caps():
    engine, runner = make_engine(
        "chunked", max_num_seqs=16, max_num_batched_tokens=64, long_prefill_token_threshold=10,
        max_long_partial_prefills=1,
    )
    engine.add_request(list(range(50)), SamplingParams(max_tokens=2), request_id="long1")
    engine.add_request(list(range(40)), SamplingParams(max_tokens=2), request_id="long2")
    engine.add_request(list(range(5)), SamplingParams(max_tokens=2), request_id="short")
    run_all(engine)
    for out in runner.steps:
        long_chunks = [c for c in out.chunks if c.num_prompt_tokens > 10 and not c.is_decode]
        assert all(c.num_tokens <= 10 for c in long_chunks)
        assert len({c.request_id for c in long_chunks}) <= 1
    first = {}
    for i, out in enumerate(runner.steps):
        for c in out.chunks:
            first.setdefault(c.request_id, i)
    assert first["short"] == 0  # the short prompt passed the second long one
    assert first["long2"] > first["short"]


def test_prefill_first_never_mixes():
    prompts, max_tokens = workload(seed=5)
    engine, runner = make_engine("prefill-first", max_num_seqs=8, max_num_batched_tokens=128)
    for i, (p, m) in enumerate(zip(prompts, max_tokens)):
        engine.add_request(p, SamplingParams(max_tokens=m, ignore_eos=True))
        engine.step()  # requests keep arriving while others decode
    run_all(engine)
    assert {o.kind for o in runner.steps} == {"prefill", "decode"}
    # whole prompts only
    for o in runner.steps:
        for c in o.chunks:
            assert c.start == 0 or c.num_tokens == 1


def test_static_batch_admits_nobody_while_running():
    engine, runner = make_engine("static", max_num_seqs=4, max_num_batched_tokens=256)
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=10, ignore_eos=True), request_id="a")
    engine.add_request([4, 5], SamplingParams(max_tokens=3, ignore_eos=True), request_id="b")
    engine.step()
    engine.add_request([6, 7], SamplingParams(max_tokens=3, ignore_eos=True), request_id="late")
    done = run_all(engine)
    a_finish = done["a"].timing.finish
    assert done["late"].timing.first_scheduled > a_finish
    assert done["b"].timing.finish < a_finish


def test_priority_orders_admission():
    engine, runner = make_engine("prefill-first", max_num_seqs=1, max_num_batched_tokens=64)
    engine.add_request([1, 2], SamplingParams(max_tokens=2), request_id="low", priority=5)
    engine.add_request([1, 2], SamplingParams(max_tokens=2), request_id="high", priority=-1)
    engine.add_request([1, 2], SamplingParams(max_tokens=2), request_id="mid", priority=0)
    done = run_all(engine)
    order = sorted(done, key=lambda r: done[r].timing.first_scheduled)
    assert order == ["high", "mid", "low"]


def test_request_that_can_never_fit_is_rejected():
    engine, _ = make_engine(num_blocks=4, block_size=4)
    with pytest.raises(ValueError, match="KV cache"):
        engine.add_request(list(range(10)), SamplingParams(max_tokens=10))
    assert not engine.has_unfinished_requests()
    engine.add_request(list(range(10)), SamplingParams(max_tokens=6))
    run_all(engine)


def test_abort_frees_blocks_and_others_continue():
    engine, _ = make_engine("chunked", max_num_batched_tokens=8)
    engine.add_request(list(range(30)), SamplingParams(max_tokens=50, ignore_eos=True), request_id="x")
    engine.add_request(list(range(5)), SamplingParams(max_tokens=5, ignore_eos=True), request_id="y")
    for _ in range(3):
        engine.step()
    assert engine.allocator.num_used_blocks > 0
    assert engine.abort_request("x")
    assert not engine.abort_request("x")
    assert not engine.abort_request("nope")
    done = run_all(engine)
    assert set(done) == {"y"} and done["y"].finish_reason == "length"


def test_failed_step_fails_only_its_requests():
    engine, runner = make_engine("prefill-first", max_num_seqs=1, max_num_batched_tokens=64)
    runner.fail_when = lambda out: any(c.request_id == "bad" for c in out.chunks)
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True), request_id="bad")
    engine.add_request([4, 5, 6], SamplingParams(max_tokens=3, ignore_eos=True), request_id="good")
    done = run_all(engine)
    assert done["bad"].finish_reason == "error" and done["bad"].error
    assert done["good"].finish_reason == "length" and len(done["good"].token_ids) == 3
    assert engine.step_stats[0].error is not None


def test_eos_and_stop_token_ids():
    engine, runner = make_engine()
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=20, ignore_eos=True))
    (out,) = run_all(engine).values()
    stop_tok = out.token_ids[4]
    first = out.token_ids.index(stop_tok)
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=20, stop_token_ids=[stop_tok]))
    (out2,) = run_all(engine).values()
    assert out2.finish_reason == "stop" and out2.token_ids == out.token_ids[: first + 1]


def test_context_length_ends_request():
    engine, _ = make_engine(max_model_len=20)
    engine.add_request(list(range(15)), SamplingParams(max_tokens=100, ignore_eos=True))
    (out,) = run_all(engine).values()
    assert out.finish_reason == "length" and len(out.token_ids) == 5


def test_timing_data_recorded():
    engine, _ = make_engine("chunked", max_num_batched_tokens=8)
    engine.add_request(list(range(20)), SamplingParams(max_tokens=5, ignore_eos=True))
    (out,) = run_all(engine).values()
    t = out.timing
    assert t.arrival < t.first_scheduled < t.first_token <= t.finish
    assert len(t.token_times) == 5 and t.token_times == sorted(t.token_times)
    assert len(t.itls) == 4 and t.ttft > 0 and t.e2e >= t.ttft
    stats = engine.step_stats
    assert sum(s.num_prefill_tokens for s in stats) == 20
    assert sum(s.num_decode_tokens for s in stats) == 4
    assert all(s.duration >= 0 and s.kv_blocks_total == 256 for s in stats)


@pytest.mark.parametrize("seed", range(3))
def test_random_arrivals_and_aborts_keep_invariants(seed):
    rng = random.Random(seed)
    policy = POLICIES[seed % 3]
    engine, _ = make_engine(policy, num_blocks=20, max_num_seqs=6, max_num_batched_tokens=24)
    ids = itertools.count()
    live: list[str] = []
    for _ in range(300):
        r = rng.random()
        if r < 0.3:
            rid = f"q{next(ids)}"
            engine.add_request([rng.randrange(256) for _ in range(rng.randint(1, 30))],
                               SamplingParams(max_tokens=rng.randint(1, 20)), request_id=rid)
            live.append(rid)
        elif r < 0.4 and live:
            engine.abort_request(live.pop(rng.randrange(len(live))))
        for out in engine.step():
            if out.finished and out.request_id in live:
                live.remove(out.request_id)
        engine.scheduler.check_invariants()
    run_all(engine)
