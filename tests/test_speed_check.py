"""The speed check: a measured profile rescaled to the machine's speed of the moment."""

from __future__ import annotations

import json

import pytest

from tandem.bench.speed_check import PROBE, ratio, recorded, rescaled, speed_check
from tandem.core.step_time import StepCost, features
from tandem.sim.design import compact
from tandem.sim.profile import describe, profile_from_dict
from tandem.sim.schema import SchemaError

from test_simulate import MEASURED


def _profile(**extra) -> dict:
    return {**json.loads(json.dumps(MEASURED)), **extra}


def test_recorded_takes_the_calibrations_times_and_prices_the_rest_by_the_fit():
    d = _profile(fit={"timed": [{"spans": compact(PROBE["prefill 256"]), "seconds": 0.5}]})
    got = recorded(d)
    assert got["prefill 256"] == 0.5
    forward = StepCost(**d["forward"])
    assert got["decode x16 at 128"] == pytest.approx(forward.predict(features(PROBE["decode x16 at 128"])))
    assert compact(PROBE["decode x16 at 128"]) == [[128, 1, 16]]


def test_recorded_prefers_the_check_run_right_after_the_calibration():
    d = _profile(speed_probe_ms={"prefill 256": 300.0},
                 fit={"timed": [{"spans": compact(PROBE["prefill 256"]), "seconds": 0.5}]})
    assert recorded(d)["prefill 256"] == pytest.approx(0.3)
    with pytest.raises(SchemaError, match=r"speed_probe_ms\.prefill 256: must be a number > 0"):
        profile_from_dict(_profile(speed_probe_ms={"prefill 256": 0}), "profile p.json")


def test_ratio_is_the_geometric_mean_over_the_steps_both_timed():
    then = {"a": 1.0, "b": 2.0, "c": 1.0}
    assert ratio({"a": 2.0, "b": 1.0}, then) == pytest.approx(1.0)  # twice as slow and twice as fast
    assert ratio({"a": 1.5, "b": 3.0, "c": 1.5}, then) == pytest.approx(1.5)
    assert ratio({"a": 2.0, "b": 1.0}, then, ["a"]) == pytest.approx(2.0)
    with pytest.raises(ValueError, match="no probe step"):
        ratio({"x": 1.0}, then)


def test_a_check_gives_the_prompt_steps_and_the_decode_steps_ratios_apart():
    then = recorded(MEASURED)
    now = {k: v * (1.2 if k == "prefill 256" else 0.8) for k, v in then.items()}
    check = speed_check(MEASURED, now)
    assert check["prefill_ratio"] == pytest.approx(1.2) and check["decode_ratio"] == pytest.approx(0.8)
    assert check["ratio"] == pytest.approx((1.2 * 0.8 * 0.8) ** (1 / 3))
    assert check["steps_ms"]["prefill 256"]["now"] == pytest.approx(1200 * then["prefill 256"])
    out = rescaled(MEASURED, check)
    for part in ("forward", "overhead"):
        for k, v in MEASURED[part].items():
            assert out[part][k] == pytest.approx(v * (1.2 if k in ("per_token", "per_pair") else 0.8)), (part, k)


def test_rescaled_scales_every_coefficient_from_the_calibration_not_compounded():
    d = _profile()
    twice = rescaled(d, {"ratio": 2.0})
    assert twice["forward"]["per_token"] == pytest.approx(2 * d["forward"]["per_token"])
    assert twice["overhead"]["per_seq"] == pytest.approx(2 * d["overhead"]["per_seq"])
    assert d["forward"]["per_token"] == MEASURED["forward"]["per_token"]  # the input is left alone
    thrice = rescaled(twice, {"ratio": 3.0, "date": "2026-12-02 01:00"})
    assert thrice["forward"]["base"] == pytest.approx(3 * d["forward"]["base"])
    apart = rescaled(thrice, {"ratio": 1.0, "prefill_ratio": 2.0, "decode_ratio": 0.5})
    assert apart["forward"]["per_token"] == pytest.approx(2 * d["forward"]["per_token"])
    assert apart["forward"]["base"] == pytest.approx(0.5 * d["forward"]["base"])
    p = profile_from_dict(thrice)
    assert p.cost.base == pytest.approx(0.03) and p.prior.base == pytest.approx(3 * (0.01 + 0.002))
    assert "rescaled x3.000 by a speed check 2026-12-02 01:00" in describe(p)


def test_a_bad_speed_check_names_the_field():
    with pytest.raises(SchemaError, match=r"speed_check\.ratio: must be a number > 0"):
        profile_from_dict(_profile(speed_check={"ratio": 0}), "profile p.json")
    with pytest.raises(SchemaError, match=r"speed_check\.decode_ratio: must be a number > 0"):
        profile_from_dict(_profile(speed_check={"ratio": 1, "decode_ratio": -1}), "profile p.json")
    with pytest.raises(SchemaError, match=r"speed_check\.ratio: is required"):
        profile_from_dict(_profile(speed_check={}), "profile p.json")
