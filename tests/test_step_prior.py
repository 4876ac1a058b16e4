"""The engine's start-up estimate of the step-time model (``build.step_prior``), timed on the
simulator's virtual clock against a known cost: it prices the fixed cost a step pays for carrying
prompt work, so the first steps that mix a prompt chunk into running decodes are not predicted far
too fast (which would size them over an ITL target and read as noise the margin must cover)."""

import pytest

from tandem.build import step_prior
from tandem.core.step import KVLayout
from tandem.core.step_time import StepCost, features
from tandem.sim.runner import SimRunner, VirtualClock

MIXED = [(128, 1)] * 16 + [(0, 16)]  # sixteen decodes and a short prompt chunk


def prior_for(true: StepCost) -> StepCost:
    clock = VirtualClock()
    return step_prior(SimRunner(clock, true), KVLayout(512, 16), 8192, clock=clock)


def test_prior_prices_the_prompt_step_cost():
    true = StepCost(base=0.012, per_token=0.0009, per_seq=0.0004, per_context=2e-6, per_pair=3e-9,
                    per_prompt_step=0.030)
    prior = prior_for(true)
    assert prior.per_prompt_step == pytest.approx(0.030, rel=0.25)
    x = features(MIXED)
    assert prior.predict(x) == pytest.approx(true.predict(x), rel=0.15)
    without = StepCost(**{**true.__dict__, "per_prompt_step": 0.0})
    # the same step priced without the term would be predicted about 37% too fast
    assert without.predict(x) < 0.7 * true.predict(x)


def test_prior_without_a_prompt_step_cost_does_not_invent_one():
    true = StepCost(base=0.012, per_token=0.0009, per_seq=0.0004, per_context=2e-6, per_pair=3e-9)
    prior = prior_for(true)
    assert prior.per_prompt_step < 0.004  # a tenth of the case above
    for spans in ([(0, 1)], [(0, 16)], [(0, 256)], MIXED):
        x = features(spans)
        assert prior.predict(x) == pytest.approx(true.predict(x), rel=0.25)
