"""The step-time model's knee (a weight-read floor: a fit finds it, predictions and the online fit
keep it, profiles validate it) and the calibration's round-by-round timing of designed steps."""

from __future__ import annotations

import json
import random

import pytest

from tandem.core.step import KVLayout
from tandem.core.step_time import Observation, StepCost, StepTimeModel, features, fit_knee
from tandem.runner.step_timing import time_step_samples
from tandem.sim.design import design, fit_shapes
from tandem.sim.profile import profile_from_dict
from tandem.sim.schema import SchemaError

from profiles import MEASURED

FLOOR = StepCost(base=0.004, per_token=4e-4, per_seq=2.5e-3, per_context=1e-7, per_pair=1e-9, knee=4.0)
"""Decodes cost the same for 1 to 4 rows, then 2.9 ms a row (the shape measured on an AVX2 Zen 3)."""


def test_the_knee_prices_a_floor_up_to_its_rows_and_each_row_beyond():
    one, four, sixteen = (FLOOR.predict(features([(128, 1)] * b)) for b in (1, 4, 16))
    assert one == pytest.approx(0.004 + 4e-4 + 4 * 2.5e-3 + 129e-7 + 129e-9)
    assert four - one == pytest.approx(3 * (4e-4 + 1e-7 * 129 + 1e-9 * 129), rel=1e-6)  # no per_seq under the knee
    assert (sixteen - four) / 12 == pytest.approx(4e-4 + 2.5e-3 + 129e-7 + 129e-9, rel=1e-6)
    # knee 0 is the plain sum, and vector() stays the six coefficients
    plain = StepCost(*FLOOR.vector())
    assert plain.knee == 0 and len(FLOOR.vector()) == 6
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


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d["forward"].update(knee="high"), r"forward\.knee: must be a number >= 0"),
    (lambda d: d["forward"].update(knee=-1), r"forward\.knee: must be a number >= 0"),
])
def test_knee_schema_errors_name_the_field(mutate, message):
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
