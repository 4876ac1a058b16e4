"""A simulator: the real scheduling core on a virtual clock, with a runner whose step time is a
formula instead of a forward pass. Used to test the tuner on cases whose answer is known, and to
explore policies at scale without a model. No torch.
"""

from __future__ import annotations

from tandem.config import SchedulerConfig
from tandem.core.engine import Engine
from tandem.core.step import KVLayout, RunnerOutput, SampledToken, SchedulerOutput
# The cost of a simulated step is the step-time model's formula with known coefficients, so the
# engine's online fit of it can be checked against the truth.
from tandem.core.step_time import StepCost

__all__ = ["StepCost", "SimRunner", "SimTokenizer", "VirtualClock", "sim_engine"]


class VirtualClock:
    def __init__(self, start: float = 0.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds

    def advance_to(self, t: float) -> None:
        self.now = max(self.now, t)


class SimRunner:
    """Advances the virtual clock by the step's cost and samples a token that is never EOS."""

    def __init__(self, clock: VirtualClock, cost: StepCost, vocab_size: int = 1000) -> None:
        self.clock = clock
        self.cost = cost
        self.vocab_size = vocab_size

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        seconds = self.cost.seconds(out)
        self.clock.advance(seconds)
        sampled = {c.request_id: SampledToken(1 + (c.end % (self.vocab_size - 1)))
                   for c in out.chunks if c.samples}
        return RunnerOutput(sampled=sampled, forward_seconds=seconds)


class SimTokenizer:
    """One token per whitespace-separated word (ids hashed into the vocabulary)."""

    vocab_size = 1000
    eos_token_ids: tuple[int, ...] = (0,)

    def encode(self, text: str) -> list[int]:
        return [1 + hash(w) % (self.vocab_size - 1) for w in text.split()]

    def decode(self, ids) -> str:
        return " ".join(f"t{i}" for i in ids)


def sim_engine(config: SchedulerConfig, cost: StepCost, num_kv_blocks: int = 4096, block_size: int = 16,
               max_model_len: int = 16384) -> Engine:
    clock = VirtualClock()
    # The prior of the engine's step-time model is the true cost: what a perfect start-up estimate gives.
    return Engine(config, SimRunner(clock, cost), SimTokenizer(), KVLayout(num_kv_blocks, block_size), max_model_len,
                  clock=clock, step_prior=cost)
