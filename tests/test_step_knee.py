"""The step-time model's knee (a weight-read floor: a fit finds it, predictions and the online fit
keep it) and the simulator's step noise (a measured spread and in-load scale, drawn from a seed),
and the calibration's round-by-round timing they are measured from."""

from __future__ import annotations

import json
import random

import pytest

from tandem.bench.config import SimulateConfig
from tandem.bench.simulate import SimEvaluator, run_simulate
from tandem.core.sampling_params import SamplingParams
from tandem.core.step_time import Observation, StepCost, StepTimeModel, features, fit_knee
from tandem.runner.step_timing import time_step_samples
from tandem.core.step import KVLayout
from tandem.sim.design import design, fit_shapes
from tandem.sim.noise import StepNoise, spread
from tandem.sim.profile import SCHEMA, profile_from_dict
from tandem.sim.schema import SchemaError

FLOOR = StepCost(base=0.004, per_token=4e-4, per_seq=2.5e-3, per_context=1e-7, per_pair=1e-9, knee=4.0)
"""Decodes cost the same for 1 to 4 rows, then 2.9 ms a row (the shape measured on an AVX2 Zen 3)."""

MEASURED = {
    "schema": SCHEMA, "kind": "measured", "name": "t",
    "forward": {"base": 0.01, "per_token": 0.001, "per_seq": 0.0, "per_context": 0.0, "per_pair": 0.0},
    "overhead": {"base": 0.002, "per_token": 0.0, "per_seq": 0.0001, "per_context": 0.0, "per_pair": 0.0},
    "kv_num_blocks": 2048, "block_size": 16, "max_model_len": 4096, "machine": "test cpu", "model": "m",
    "dtype": "float32", "quantization": "none", "date": "2026-01-01 00:00",
}


def test_the_knee_prices_a_floor_up_to_its_rows_and_each_row_beyond():
    one, four, sixteen = (FLOOR.predict(features([(128, 1)] * b)) for b in (1, 4, 16))
    assert one == pytest.approx(0.004 + 4e-4 + 4 * 2.5e-3 + 129e-7 + 129e-9)
    assert four - one == pytest.approx(3 * (4e-4 + 1e-7 * 129 + 1e-9 * 129), rel=1e-6)  # no per_seq under the knee
    assert (sixteen - four) / 12 == pytest.approx(4e-4 + 2.5e-3 + 129e-7 + 129e-9, rel=1e-6)
    # knee 0 is the plain sum, and vector() stays the five coefficients
    plain = StepCost(*FLOOR.vector())
    assert plain.knee == 0 and len(FLOOR.vector()) == 5
    assert plain.predict(features([(128, 1)])) == pytest.approx(0.004 + 4e-4 + 2.5e-3 + 129e-7 + 129e-9)


def test_the_calibration_fit_finds_a_known_knee_and_keeps_none_where_there_is_none():
    rng = random.Random(5)
    shapes = design(200_000, 8192, max_chunk=2048, block_size=16)
    timed = [(s, FLOOR.predict(features(s)) * rng.gauss(1.0, 0.005)) for s in shapes]
    got = fit_shapes(timed)
    assert got.knee == 4.0
    for name in ("base", "per_token", "per_seq"):
        assert getattr(got, name) == pytest.approx(getattr(FLOOR, name), rel=0.15), name
    # the plain fit cannot follow the bend: it misprices a 4-row decode by more than the noise
    plain = fit_shapes(timed, knees=(0.0,))
    x4 = features([(128, 1)] * 4)
    assert abs(plain.predict(x4) / FLOOR.predict(x4) - 1) > 0.05
    assert got.predict(x4) == pytest.approx(FLOOR.predict(x4), rel=0.03)
    linear = StepCost(*FLOOR.vector())
    timed = [(s, linear.predict(features(s)) * rng.gauss(1.0, 0.005)) for s in shapes]
    assert fit_shapes(timed).knee == 0.0


def test_the_online_fit_keeps_the_priors_knee():
    rng = random.Random(2)
    model = StepTimeModel(StepCost(base=0.01, per_token=1e-3, per_seq=1e-3, knee=4.0), window=128, refit_every=16)
    for _ in range(256):
        spans = [(rng.randint(16, 900), 1) for _ in range(rng.randint(1, 24))] + [(0, rng.randint(1, 256))] * rng.randint(0, 1)
        x = features(spans)
        model.observe(x, FLOOR.predict(x))
    assert model.coefficients.knee == 4.0
    x = features([(300, 1)] * 2)
    assert model.predict(x) == pytest.approx(FLOOR.predict(x), rel=0.05)
    assert fit_knee([Observation(x, FLOOR.predict(x))], StepCost(), 0.01, knees=(0.0, 4.0)).knee in (0.0, 4.0)


def test_step_noise_draws_from_its_samples_from_a_seed():
    a, b = StepNoise((0.9, 1.0, 1.5), 2.0, seed=7), StepNoise((0.9, 1.0, 1.5), 2.0, seed=7)
    draws = [a.factor() for _ in range(200)]
    assert draws == [b.factor() for _ in range(200)]
    assert set(draws) == {1.8, 2.0, 3.0}
    assert StepNoise((), 1.25).factor() == 1.25
    with pytest.raises(ValueError, match="step_noise"):
        StepNoise((1.0, 0.0))
    assert spread([[1.0, 2.0, 4.0], [5.0, 5.0], [3.0, 3.0, 6.0]]) == [0.5, 1.0, 1.0, 1.0, 2.0, 2.0]


def _run(profile: dict, noise: bool = True, seed: int = 0):
    engine = SimEvaluator(profile_from_dict(profile), noise=noise, seed=seed).engine({"max_num_batched_tokens": 64})
    for _ in range(4):
        engine.add_request(list(range(1, 100)), SamplingParams(max_tokens=8, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    return engine.step_stats


def test_the_simulator_scales_and_draws_each_forward_pass_and_noise_can_be_switched_off():
    plain = _run(MEASURED)
    scaled = _run({**MEASURED, "in_load_scale": 2.0})
    assert [s.spans() for s in scaled] == [s.spans() for s in plain]
    assert all(s.forward_seconds == pytest.approx(2 * p.forward_seconds) for s, p in zip(scaled, plain))
    noisy = {**MEASURED, "step_noise": {"ratios": [0.8, 1.0, 1.0, 1.7]}}
    one, again, other = _run(noisy), _run(noisy), _run(noisy, seed=1)
    ratios = [s.forward_seconds / p.forward_seconds for s, p in zip(one, plain)]
    assert {round(r, 9) for r in ratios} <= {0.8, 1.0, 1.7} and len({round(r, 9) for r in ratios}) > 1
    assert [s.forward_seconds for s in one] == [s.forward_seconds for s in again]
    assert [s.forward_seconds for s in one] != [s.forward_seconds for s in other]
    off = _run(noisy, noise=False)
    assert [s.forward_seconds for s in off] == [s.forward_seconds for s in plain]


def test_simulate_with_noise_is_deterministic_for_a_seed_and_says_so(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps({**MEASURED, "step_noise": {"ratios": [0.9, 1.0, 1.0, 1.4]}, "in_load_scale": 1.1}))
    out = []
    for i, noise in enumerate((True, True, False)):
        cfg = SimulateConfig(scenario="sharegpt-bursty", configs=("policy=chunked,max_num_batched_tokens=256",),
                             profile=str(path), result_dir=str(tmp_path / f"r{i}"), seed=3, noise=noise)
        run_simulate(cfg)
        out.append(json.loads((tmp_path / f"r{i}" / "compare.json").read_text())["configs"][0])
    strip = lambda r: {k: v for k, v in r.items() if k != "date"}  # noqa: E731
    assert strip(out[0]) == strip(out[1]) and strip(out[0]) != strip(out[2])
    md = (tmp_path / "r0" / "compare.md").read_text()
    assert "each step drawn from its measured spread" in md and "x1.100 in load" in md
    assert "step noise off" in (tmp_path / "r2" / "compare.md").read_text()


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d.update(step_noise={"ratios": []}), r"step_noise\.ratios: must be a non-empty JSON array"),
    (lambda d: d.update(step_noise={"ratios": [1.0, -2]}), r"step_noise\.ratios\[1\]: must be a number > 0"),
    (lambda d: d.update(step_noise={}), r"step_noise\.ratios: is required"),
    (lambda d: d.update(in_load_scale=0), r"in_load_scale: must be a number > 0"),
    (lambda d: d["forward"].update(knee="high"), r"forward\.knee: must be a number >= 0"),
])
def test_noise_and_knee_schema_errors_name_the_field(mutate, message):
    d = json.loads(json.dumps(MEASURED))
    mutate(d)
    with pytest.raises(SchemaError, match=message):
        profile_from_dict(d, "profile p.json")


class _Recorder:
    def __init__(self) -> None:
        self.order: list[int] = []

    def execute(self, out) -> None:
        self.order.append(len(out.chunks))


def test_designed_steps_are_timed_round_by_round():
    runner = _Recorder()
    shapes = [[(0, 8)], [(16, 1)] * 2, [(16, 1)] * 3]
    seen = []
    samples = time_step_samples(runner, KVLayout(64, 16), shapes, 3, progress=seen.append)
    assert runner.order == [1, 2, 3] * 4  # one untimed round, then three timed ones
    assert [len(runs) for _, runs in samples] == [3, 3, 3] and [s for s, _ in samples] == shapes
    assert seen[-1] == pytest.approx(3) and seen == sorted(seen)
