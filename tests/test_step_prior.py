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


class TiledRoad:
    """A step's cost where the prompt rows of prompts of 32+ tokens are multiplied in whole tiles of
    128 rows (w8a8's bf16 road on AMX): a short chunk of a long prompt costs a tile, a fresh short
    prompt only its rows."""

    def __init__(self, linear: StepCost, tile_seconds: float) -> None:
        self.linear, self.tile_seconds = linear, tile_seconds

    def seconds(self, out) -> float:
        spans = [(c.start, c.num_tokens) for c in out.chunks]
        road = sum(c.num_tokens for c in out.chunks if not c.is_decode and c.num_prompt_tokens >= 32)
        return self.linear.predict(features(spans)) + self.tile_seconds * -(-road // 128)


def test_prior_prices_a_short_chunk_of_a_long_prompt_on_its_prompts_road():
    linear = StepCost(base=0.008, per_token=0.0002, per_seq=0.0003, per_context=1e-6)
    cost = TiledRoad(linear, tile_seconds=0.030)
    clock = VirtualClock()
    prior = step_prior(SimRunner(clock, cost), KVLayout(512, 16), 8192, clock=clock)
    # sixteen decodes beside a 16-token chunk of a 256-token prompt: the step an ITL target cuts
    mixed = [(128, 1)] * 16 + [(128, 16)]
    truth = linear.predict(features(mixed)) + 0.030
    assert prior.predict(features(mixed)) == pytest.approx(truth, rel=0.2)
    assert prior.per_prompt_step > 0.015  # the tile, not a fresh short prompt's few rows


@pytest.mark.parametrize("max_num_seqs", [16, 32, 64])
def test_prior_prices_a_full_batch_of_decodes_as_measured(max_num_seqs):
    # a cost whose per-stream term grows with the batch (attention over many streams' caches): a fit
    # of one decode and prompt chunks alone would extrapolate a full batch far from its cost
    class Superlinear:
        def __init__(self, linear: StepCost) -> None:
            self.linear = linear

        def seconds(self, out) -> float:
            spans = [(c.start, c.num_tokens) for c in out.chunks]
            decodes = sum(1 for c in out.chunks if c.is_decode)
            return self.linear.predict(features(spans)) + 2e-5 * decodes * decodes

    linear = StepCost(base=0.010, per_token=0.0004, per_seq=0.0002, per_context=1e-6)
    clock = VirtualClock()
    prior = step_prior(SimRunner(clock, Superlinear(linear)), KVLayout(512, 16), 8192, clock=clock,
                       max_num_seqs=max_num_seqs)
    full = [(256, 1)] * max_num_seqs
    truth = linear.predict(features(full)) + 2e-5 * max_num_seqs ** 2
    assert prior.predict(features(full)) == pytest.approx(truth, rel=0.15)


def test_a_slow_machine_still_times_the_full_batch():
    # every step a few hundred ms (a slow CPU): the warm-up's time runs out after the first shapes,
    # but the full batch, which the default ITL target is priced by, is timed all the same
    slow = StepCost(base=0.150, per_token=0.002, per_seq=0.003, per_context=4e-6)
    clock = VirtualClock()
    runner = SimRunner(clock, slow)
    prior = step_prior(runner, KVLayout(512, 16), 8192, clock=clock, max_num_seqs=32)
    full = features([(256, 1)] * 32)
    assert prior.predict(full) == pytest.approx(slow.predict(full), rel=0.1)
    assert clock() < 10 * 0.8  # and the long-context shapes were left out
