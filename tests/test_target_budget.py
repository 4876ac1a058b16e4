"""The ITL-/TTFT-target prefill share of the chunked policy, on the simulator (virtual clock, a
step cost the model knows): steps stay within the target while decodes run, ITL p99 meets the
target where a fixed large budget does not, the TTFT arbitration, and validation of the knobs
and of the per-request fields (config, engine, HTTP 400)."""

import dataclasses
import random

import pytest

from tandem.config import SchedulerConfig
from tandem.core.budget import Planned
from tandem.core.request import Request, SamplingParams
from tandem.core.step_time import StepCost, StepTimeModel, features
from tandem.core.gap_ledgers import MARGIN_MIN_STEPS, NoiseMargin, OverrunLedger
from tandem.core.target_budget import PrefillShare, itl_target
from tandem.sim import StepCost as SimStepCost
from tandem.sim import sim_engine

COST = StepCost(base=0.010, per_token=0.0004, per_seq=0.0002, per_context=1e-6, per_pair=2e-9)
BLOCK = 16
T_MS = 40.0
STRICT = {"itl_overrun_share": 0.0}  # no step may run over the target (the default allows 0.9%)
FIXED = {"itl_target_factor": 0.0}  # a fixed budget: no target at all (the default sets one)


def run_mixed(config: SchedulerConfig, seed: int = 0, cost=COST):
    """Eight long streams, then long prompts (1-3k tokens) arriving while they decode."""
    engine = sim_engine(config, cost, num_kv_blocks=4096, block_size=BLOCK, prior=COST)
    rng = random.Random(seed)
    arrivals = [(0.0, rng.randint(50, 200), 300) for _ in range(8)]
    arrivals += [(0.2 + 0.25 * i, rng.randint(1000, 3000), 20) for i in range(12)]
    clock = engine.clock
    pending = sorted(arrivals)
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][0] <= clock.now:
            t, prompt, out = pending.pop(0)
            engine.add_request(ids(prompt, start=len(engine.scheduler.requests) * 37 + int(t * 1000)), SamplingParams(max_tokens=out, ignore_eos=True),
                               arrival_time=t)
        if not engine.has_unfinished_requests():
            clock.advance_to(pending[0][0])
            continue
        engine.step()
        engine.scheduler.check_invariants()
    assert engine.allocator.all_free()
    return engine


def ids(n: int, start: int = 0) -> list[int]:
    """Prompts that start differently share no cached prefix (the simulator's vocabulary is 1000)."""
    return [1 + (start + i) % 998 for i in range(n)]


def p99(values):
    values = sorted(values)
    return values[min(len(values) - 1, int(0.99 * len(values)))]


def collect(config):
    engine = run_mixed(config)
    return engine, engine.step_stats


def all_itls(engine_steps):
    """Every gap between consecutive steps that carried a decode: what each stream saw."""
    gaps = []
    last = {}
    for s in engine_steps:
        end = s.start + s.duration
        for c in s.chunks:
            if c.samples:
                if c.request_id in last and c.is_decode:
                    gaps.append(end - last[c.request_id])
                last[c.request_id] = end
    return gaps


def test_sim_cost_is_the_models():
    assert SimStepCost is StepCost


def test_no_step_predicted_over_the_target_while_decodes_run():
    config = SchedulerConfig(max_num_batched_tokens=2048, target_itl_ms=T_MS, **STRICT)
    _, steps = collect(config)
    checked = 0
    for s in steps:
        if s.num_decode_tokens:
            checked += 1
            assert s.predicted_seconds <= T_MS / 1e3 + 1e-12 or s.num_prefill_tokens <= BLOCK, s
            # each such step records why it was sized: the target, with the ITL share setting its
            # prompt work, or no prompt to size
            assert s.sizing.target_seconds == pytest.approx(T_MS / 1e3), s.sizing
            assert s.sizing.limit == ("itl" if s.num_prefill_tokens else "none"), s
        else:
            assert s.sizing is None  # nobody streams: no target applied
    assert checked > 100
    # and prompts still moved in steps that carried decodes (the target shares, it does not starve)
    assert sum(s.num_prefill_tokens for s in steps if s.num_decode_tokens) > 10_000


def test_itl_p99_meets_the_target_where_a_fixed_budget_breaks_it():
    fixed = all_itls(collect(SchedulerConfig(max_num_batched_tokens=2048, **FIXED))[1])
    targeted = all_itls(collect(SchedulerConfig(max_num_batched_tokens=2048, target_itl_ms=T_MS, **STRICT))[1])
    assert p99(fixed) > 2 * T_MS / 1e3
    assert p99(targeted) <= T_MS / 1e3 * 1.02


def test_overrun_ledger_worked_example():
    ledger = OverrunLedger(0.01, window=1000)
    assert not ledger.allows(4)  # nothing earned yet
    for _ in range(99):
        ledger.record(4, 0.030, 0.040)  # 396 gaps within the target
    # 4 more gaps over it would make 4 of 400: exactly 1%
    assert ledger.allows(4) and not ledger.allows(5)
    ledger.record(4, 0.090, 0.040)
    assert (ledger.gaps, ledger.over) == (400, 4) and not ledger.allows(1)
    for _ in range(150):  # the window forgets the oldest steps, the overrun among them
        ledger.record(4, 0.030, 0.040)
    assert ledger.gaps <= 1000 and ledger.over == 4
    for _ in range(150):
        ledger.record(4, 0.030, 0.040)
    assert ledger.over == 0 and ledger.allows(9)
    ledger.record(0, 5.0, 0.040)  # a step without decodes is no gap
    assert ledger.gaps <= 1000 and OverrunLedger(0.0).allows(1) is False


def test_overrun_share_finishes_prompts_sooner_within_its_allowance():
    base = SchedulerConfig(max_num_batched_tokens=2048, target_itl_ms=T_MS, **STRICT)
    strict = collect(base)
    # the allowance alone: a burst pause (tests/test_burst_pause.py) would spend it first here
    spent = collect(dataclasses.replace(base, itl_overrun_share=0.005, max_pause_ms=0))
    gaps = all_itls(spent[1])
    over = sum(g > T_MS / 1e3 + 1e-9 for g in gaps)
    assert 0 < over <= 0.005 * len(gaps) + 8  # at most one step's decodes beyond the share
    assert p99(gaps) <= T_MS / 1e3 * 1.02
    # the steps that ran over carried prompt tokens beyond the ITL share
    assert any(s.num_decode_tokens and s.predicted_seconds > T_MS / 1e3 and s.num_prefill_tokens > BLOCK
               for s in spent[1])
    # and they are the steps recorded as sized by the allowance; the strict run records none
    for s in spent[1]:
        if s.num_decode_tokens and s.predicted_seconds > T_MS / 1e3 + 1e-9 and s.num_prefill_tokens > BLOCK:
            assert s.sizing.limit == "overrun", s
    assert any(s.sizing is not None and s.sizing.overrun for s in spent[1])
    assert not any(s.sizing is not None and s.sizing.overrun for s in strict[1])
    def first_tokens(steps):  # the same arrivals in both runs: the sums compare total TTFT
        first = {}
        for st in steps:
            for c in st.chunks:
                if c.samples:
                    first.setdefault(c.request_id, st.start + st.duration)
        return sum(first.values())
    assert first_tokens(spent[1]) < first_tokens(strict[1])


def test_noise_margin_worked_example():
    m = NoiseMargin(0.005)
    assert m.factor == 1.0 and MARGIN_MIN_STEPS == 1  # nothing measured yet
    m.record(8, True, 0.040, 0.040 * 1.25)
    assert m.factor == pytest.approx(0.8)  # one step measured: its ratio
    m = NoiseMargin(0.005)
    for i in range(100):  # decode-only steps: gaps, no ratio
        m.record(8, False, 0.020, 0.020)
    for i in range(32):  # steps with prompt work, measured 1.00x .. 1.31x their prediction
        m.record(8, True, 0.040, 0.040 * (1 + i / 100))
    # 256 of the 1,056 gaps were in those steps: they may run over on 0.005 * 1056 / 256 = 2.06% of
    # them, the (1 - 0.0206) quantile of 32 ratios is the largest: 1.31
    assert m.factor == pytest.approx(1 / 1.31)
    for i in range(200):  # more decode-only gaps
        m.record(8, False, 0.020, 0.020)
    assert m.factor == pytest.approx(1 / 1.31)  # recomputed only when a step with prompt work is measured
    m.record(8, True, 0.040, 0.040)
    # now 264 of 2,664 gaps: 5.05% of those steps may run over; of the 33 ratios sorted, index
    # int(0.9495 * 33) = 31 is 1.30
    assert (m.gaps, m.mixed_gaps) == (2664, 264) and m.factor == pytest.approx(1 / 1.30)
    fast = NoiseMargin(0.005)
    for i in range(40):  # steps faster than predicted do not raise the target
        fast.record(8, True, 0.040, 0.030)
    assert fast.factor == 1.0
    off = NoiseMargin(0.0)
    for i in range(40):
        off.record(8, True, 0.040, 0.080)
    assert off.factor == 1.0


class NoisyCost:
    """The known cost, with steps that carry prompt work running 0-40% longer (seeded)."""

    def __init__(self, seed: int = 0) -> None:
        self.rng = random.Random(seed)

    def seconds(self, out) -> float:
        t = COST.seconds(out)
        return t * (1 + 0.4 * self.rng.random()) if any(not c.is_decode for c in out.chunks) else t


def test_noise_margin_keeps_measured_gaps_within_the_target_on_a_noisy_machine():
    base = SchedulerConfig(max_num_batched_tokens=2048, target_itl_ms=T_MS, **STRICT)
    runs = {}
    for share in (0.0, 0.005):
        engine = run_mixed(dataclasses.replace(base, itl_margin_share=share), cost=NoisyCost())
        gaps = all_itls(engine.step_stats)
        runs[share] = (sum(g > T_MS / 1e3 + 1e-9 for g in gaps) / len(gaps), p99(gaps), engine.scheduler.policy)
    blind, margined = runs[0.0], runs[0.005]
    assert blind[0] > 0.05 and blind[1] > T_MS / 1e3  # sized to T, the noisy steps run over it
    assert margined[0] <= 0.01 and margined[1] <= T_MS / 1e3
    assert 0.7 < margined[2].margin.factor < 0.9  # about 1 / 1.4 at most, less where fewer may run over
    # every step is still predicted within the target
    for s in engine.step_stats:
        if s.num_decode_tokens:
            assert s.predicted_seconds <= T_MS / 1e3 + 1e-12 or s.num_prefill_tokens <= BLOCK


def test_full_budget_when_nothing_decodes():
    config = SchedulerConfig(max_num_batched_tokens=512, target_itl_ms=T_MS)
    engine = sim_engine(config, COST, block_size=BLOCK)
    engine.add_request(ids(1999), SamplingParams(max_tokens=2, ignore_eos=True))
    engine.step()
    assert engine.step_stats[0].num_prefill_tokens == 512  # far over T's share: nobody streams


def test_per_request_itl_target_is_the_tightest_running():
    fast = Request("a", [1], SamplingParams(target_itl_ms=25.0), 0.0, 100)
    plain = Request("b", [1], SamplingParams(), 0.0, 100)
    assert itl_target([fast, plain], 100.0) == pytest.approx(0.025)
    assert itl_target([plain], 100.0) == pytest.approx(0.1)
    assert itl_target([plain], None) is None
    assert itl_target([plain], 0) is None  # 0 is off


def _share(decodes: int, ttft_ms=None, itl_ms=20.0, now=0.0):
    """A step with ``decodes`` decodes planned at context 100, under a model that knows COST."""
    planned = []
    for i in range(decodes):
        r = Request(f"d{i}", list(range(1, 101)), SamplingParams(), 0.0, 10_000)
        r.num_computed_tokens = 100
        planned.append(Planned(r, 100, 1))
    settings = SchedulerConfig(target_itl_ms=itl_ms, target_ttft_ms=ttft_ms)
    return PrefillShare(StepTimeModel(COST), planned, settings, BLOCK, now)


def test_itl_share_worked_example():
    # 4 decodes at context 100: 10 + 4 * (0.4 + 0.2 + 0.101 + 0.0002) ms = 12.8 ms; a 20 ms target leaves
    # 7.2 ms: a fresh chunk of n tokens costs 0.2 + 0.4 n + 0.001 n + 0.000002 n(n+1)/2 ms -> n = 17
    share = _share(4)
    prompt = Request("p", list(range(1, 1001)), SamplingParams(), 0.0, 10_000)
    n = share.size(prompt, 512)
    assert n == 17
    share.take(0, n)
    assert share.predicted() <= 0.020
    # the step is full: the next prompt gets nothing (the one-block minimum is spent)
    other = Request("q", list(range(1, 1001)), SamplingParams(), 0.0, 10_000)
    assert share.size(other, 512) == 0


def _decodes(n: int, context: int = 100) -> list[Planned]:
    planned = []
    for i in range(n):
        r = Request(f"d{i}", list(range(1, context + 1)), SamplingParams(), 0.0, 10_000)
        r.num_computed_tokens = context
        planned.append(Planned(r, context, 1))
    return planned


def test_factor_target_is_a_multiple_of_a_full_batch_of_decodes():
    # no explicit target: 2x the 12.8 ms that a full batch (max_num_seqs = 4) of decodes takes =
    # 25.6 ms, leaving 12.8 ms of prefill: 0.2 + 0.401 n + 0.000002 n(n+1)/2 <= 12.8 ms -> n = 31
    planned = _decodes(4)
    factor = SchedulerConfig(itl_target_factor=2.0, min_target_itl_ms=5.0, max_num_seqs=4)
    share = PrefillShare(StepTimeModel(COST), planned, factor, BLOCK, 0.0)
    assert share.target == pytest.approx(2 * 0.0128, rel=1e-3)
    prompt = Request("p", list(range(1, 1001)), SamplingParams(), 0.0, 10_000)
    assert share.size(prompt, 512) == 31
    # one stream running: the same target (a full batch's), not 2x its own 10.7 ms step
    alone = PrefillShare(StepTimeModel(COST), _decodes(1), factor, BLOCK, 0.0)
    assert alone.target == pytest.approx(share.target)
    # more streams than max_num_seqs (never planned, but the batch is what runs): counted as they are
    assert PrefillShare(StepTimeModel(COST), _decodes(8), factor, BLOCK, 0.0).target > share.target
    # the mean context of the running streams sets the full batch's context
    longer = PrefillShare(StepTimeModel(COST), _decodes(2, 1000), factor, BLOCK, 0.0)
    assert longer.target == pytest.approx(2 * StepTimeModel(COST).predict(features([(1000, 1)] * 4)))
    # the floor: a target never tighter than min_target_itl_ms
    floored = PrefillShare(StepTimeModel(COST), planned, SchedulerConfig(itl_target_factor=1.0, max_num_seqs=4),
                           BLOCK, 0.0)
    assert floored.target == pytest.approx(0.020)
    # an explicit target wins over the factor; with neither, nothing limits the share
    explicit = PrefillShare(StepTimeModel(COST), planned,
                            SchedulerConfig(itl_target_factor=2.0, target_itl_ms=15.0), BLOCK, 0.0)
    assert explicit.target == pytest.approx(0.015)
    assert not PrefillShare(StepTimeModel(COST), planned, SchedulerConfig(**FIXED), BLOCK, 0.0).limited
    # the default sets a target: a factor of a full batch of decodes
    default = SchedulerConfig()
    assert default.itl_target_factor > 1 and PrefillShare(StepTimeModel(COST), planned, default, BLOCK, 0.0).limited


def test_factor_target_is_priced_by_the_start_up_estimate_not_the_online_fit():
    # the online fit of a load's first steps (a few decodes beside prompt chunks) extrapolates a
    # full batch far off its cost; the target stays the start-up estimate's multiple whatever it says
    planned = _decodes(4)
    factor = SchedulerConfig(itl_target_factor=2.0, min_target_itl_ms=5.0, max_num_seqs=32)
    fitted = StepTimeModel(COST)
    before = PrefillShare(fitted, planned, factor, BLOCK, 0.0).target
    assert before == pytest.approx(2 * COST.predict(features([(100, 1)] * 32)))
    fitted.coefficients = StepCost(**{**COST.__dict__, "per_seq": 10 * COST.per_seq})  # a fit 10x off per stream
    assert fitted.predict(features([(100, 1)] * 32)) > 2.5 * COST.predict(features([(100, 1)] * 32))
    assert PrefillShare(fitted, planned, factor, BLOCK, 0.0).target == pytest.approx(before)


def test_one_block_minimum_when_decodes_alone_exceed_the_target():
    share = _share(40)  # 40 decodes: 38 ms of decodes under a 20 ms target
    prompt = Request("p", list(range(1, 1001)), SamplingParams(), 0.0, 10_000)
    assert share.size(prompt, 512) == BLOCK
    short = Request("s", list(range(1, 6)), SamplingParams(), 0.0, 10_000)
    assert share.size(short, 5) == 5


def test_ttft_target_takes_a_larger_share_only_when_it_can_make_it():
    now = 1.0
    # ITL share: 17 tokens per ~20 ms step -> 1000 tokens take ~59 steps (~1.2 s)
    itl_only = _share(4, now=now).size(Request("p", list(range(1, 1001)), SamplingParams(), 0.0, 10_000), 512)
    # a deadline 1.0 s after arrival, 0.5 s from now: reachable with bigger chunks
    share = _share(4, ttft_ms=1000.0, now=now)
    tight = Request("t", list(range(1, 1001)), SamplingParams(), 0.5, 10_000)
    n = share.size(tight, 512)
    assert n > itl_only
    share.take(0, n)
    assert share.sizing().limit == "ttft" and share.sizing().ttft_tokens == n - itl_only
    assert share._time_to_first_token(0, 1000, n) <= 0.5
    assert share._time_to_first_token(0, 1000, n - 1) > 0.5  # the smallest chunk that makes it
    # a deadline 50 ms from now cannot be met even at the whole budget: it keeps the ITL share
    hopeless = Request("h", list(range(1, 1001)), SamplingParams(target_ttft_ms=1000.0), 0.05, 10_000)
    assert _share(4, now=now).size(hopeless, 512) == itl_only
    # on track already: no extra share
    relaxed = Request("r", list(range(1, 1001)), SamplingParams(target_ttft_ms=60_000.0), 1.0, 10_000)
    assert _share(4, now=now).size(relaxed, 512) == itl_only


def test_ttft_target_improves_long_prompts_in_the_sim():
    base = SchedulerConfig(max_num_batched_tokens=2048, target_itl_ms=T_MS, **STRICT)
    both = SchedulerConfig(max_num_batched_tokens=2048, target_itl_ms=T_MS, target_ttft_ms=1500.0, **STRICT)
    plain_steps = collect(base)[1]
    ttft_steps = collect(both)[1]
    # TTFT-boosted steps may go over T; the prefill total per unit time rises
    def prefill_rate(steps):
        span = steps[-1].start + steps[-1].duration - steps[0].start
        return sum(s.num_prefill_tokens for s in steps) / span
    assert prefill_rate(ttft_steps) >= prefill_rate(plain_steps)
    boosted = [s for s in ttft_steps
               if s.predicted_seconds > T_MS / 1e3 + 1e-9 and s.num_decode_tokens and s.num_prefill_tokens > BLOCK]
    assert boosted and all(s.sizing.limit == "ttft" and s.sizing.ttft_tokens > 0 for s in boosted)
    assert not any(s.sizing is not None and s.sizing.ttft_tokens for s in plain_steps)


@pytest.mark.parametrize("field,value", [
    ("target_itl_ms", -1.0), ("target_itl_ms", float("inf")), ("target_ttft_ms", "100"),
    ("min_target_itl_ms", -5.0), ("step_model_window", 0), ("step_model_refit_every", 0),
    ("itl_target_factor", 0.5), ("itl_target_factor", -1.0), ("itl_target_factor", float("nan")),
    ("itl_overrun_share", -0.01), ("itl_overrun_share", 0.5), ("itl_overrun_share", float("nan")),
    ("itl_margin_share", -0.01), ("itl_margin_share", 0.5), ("itl_margin_share", "0.1"),
    ("max_pause_ms", -1.0), ("max_pause_ms", float("inf")),
])
def test_config_validation_names_the_field(field, value):
    with pytest.raises(ValueError, match=f"^{field}:"):
        SchedulerConfig(**{field: value}).validate()


def test_zero_and_none_targets_are_off():
    SchedulerConfig(target_itl_ms=0, target_ttft_ms=None).validate()


@pytest.mark.parametrize("field,value", [("target_itl_ms", 0.0), ("target_ttft_ms", -3.0),
                                         ("target_itl_ms", float("nan"))])
def test_sampling_params_reject_bad_targets(field, value):
    with pytest.raises(ValueError, match=f"^{field}:"):
        SamplingParams(**{field: value})


def test_engine_bounds_request_targets_by_the_server_minimum():
    engine = sim_engine(SchedulerConfig(min_target_itl_ms=30.0, min_target_ttft_ms=200.0), COST)
    with pytest.raises(ValueError, match="^target_itl_ms: must be at least 30 ms"):
        engine.add_request([1, 2], SamplingParams(target_itl_ms=10.0))
    with pytest.raises(ValueError, match="^target_ttft_ms:"):
        engine.add_request([1, 2], SamplingParams(target_ttft_ms=100.0))
    engine.add_request([1, 2], SamplingParams(target_itl_ms=30.0, target_ttft_ms=200.0, max_tokens=2))
    while engine.has_unfinished_requests():
        engine.step()


def test_cli_flags_are_derived():
    import argparse

    from tandem.cli_args import add_engine_args, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--target-itl-ms", "150", "--target-ttft-ms", "3000", "--step-model-window", "64"])
    config = engine_config_from_args(args)
    assert (config.scheduler.target_itl_ms, config.scheduler.target_ttft_ms) == (150.0, 3000.0)
    assert config.scheduler.step_model_window == 64


def test_http_fields_validated_and_in_the_schema(tmp_path):
    from server_helpers import InProcessApp, assert_error, tiny_state

    app = InProcessApp(tiny_state(tmp_path))
    try:
        for path, body in (("/v1/completions", {"prompt": "w5 w6", "max_tokens": 2}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w5"}],
                                                     "max_tokens": 2})):
            ok = app.call("POST", path, json={**body, "target_itl_ms": 50, "target_ttft_ms": 2000.0})
            assert ok.status_code == 200, ok.text
            for field, value in (("target_itl_ms", 5), ("target_itl_ms", "x"), ("target_ttft_ms", -1),
                                 ("target_ttft_ms", 1)):
                err = assert_error(app.call("POST", path, json={**body, field: value}), 400)
                assert err["param"] == field, err
        schema = app.call("GET", "/openapi.json").json()
        text = str(schema)
        assert "target_itl_ms" in text and "target_ttft_ms" in text
    finally:
        app.close()


def test_the_minimum_is_the_runners_prompt_tile_where_it_multiplies_in_tiles():
    """Where a long prompt's chunk costs whole tiles of rows, a step forced to carry prompt work
    carries a tile of it: a block would cost the same and move a tenth as far."""
    planned = []
    for i in range(64):  # far over a 20 ms target on their own: no chunk fits
        r = Request(f"d{i}", list(range(1, 101)), SamplingParams(), 0.0, 10_000)
        r.num_computed_tokens = 100
        planned.append(Planned(r, 100, 1))
    settings = SchedulerConfig(target_itl_ms=20.0)
    prompt = Request("p", list(range(1, 1001)), SamplingParams(), 0.0, 10_000)
    assert PrefillShare(StepTimeModel(COST), planned, settings, BLOCK, 0.0).size(prompt, 512) == BLOCK
    tiled = PrefillShare(StepTimeModel(COST), planned, settings, 128, 0.0)
    assert tiled.size(prompt, 512) == 128 and tiled.size(prompt, 40) == 40
