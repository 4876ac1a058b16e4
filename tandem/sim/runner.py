"""The simulated engine: the real scheduling core on a virtual clock, with a runner whose step time
is a cost model instead of a forward pass, and a tokenizer that needs no model."""

from __future__ import annotations

import re
import zlib
from typing import Protocol

from tandem.config import SchedulerConfig
from tandem.core.engine import Engine
from tandem.core.step import KVLayout, RunnerOutput, SampledToken, SchedulerOutput
# The cost of a simulated step is the step-time model's formula with known coefficients, so the
# engine's online fit of it can be checked against the truth.
from tandem.core.step_time import StepCost  # noqa: F401  (re-exported by tandem.sim)



class Cost(Protocol):
    def seconds(self, out: SchedulerOutput) -> float: ...


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
    """Advances the virtual clock by the step's cost and samples a token that is never EOS.

    ``overhead``: the engine's time per step beyond the forward pass (scheduling, sampling,
    detokenizing, the serving loop), on the clock but not in ``forward_seconds``, as on a real engine."""

    def __init__(self, clock: VirtualClock, cost: Cost, vocab_size: int = 1000, overhead: Cost | None = None) -> None:
        self.clock = clock
        self.cost = cost
        self.overhead = overhead
        self.vocab_size = vocab_size

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        seconds = self.cost.seconds(out)
        extra = self.overhead.seconds(out) if self.overhead is not None else 0.0
        self.clock.advance(seconds + extra)
        sampled = {c.request_id: SampledToken(1 + (c.end % (self.vocab_size - 1)))
                   for c in out.chunks if c.samples}
        return RunnerOutput(sampled=sampled, forward_seconds=seconds)


_ID_WORD = re.compile(r"t(\d+)\Z")
BOS_TOKEN_ID = 1


class SimTokenizer:
    """One token per whitespace-separated word. Ids are a stable hash of the word (the same text
    gives the same ids in every process, so shared prefixes share ids and a seed reproduces a run),
    and ``decode`` writes ``t<id>`` words that encode back to the same ids: prompts cut to exact
    token lengths by the scenario builders keep their lengths.

    ``add_bos``: ``encode`` puts ``BOS_TOKEN_ID`` first, as the model's tokenizer does for a model
    that wants a BOS token (the engine's prompts are one token longer than the words cut for them);
    ``add_special_tokens=False`` leaves it out, as for the real tokenizer."""

    eos_token_ids: tuple[int, ...] = (0,)

    def __init__(self, vocab_size: int = 1000, add_bos: bool = False) -> None:
        self.vocab_size = vocab_size
        self.add_bos = add_bos

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        out = [BOS_TOKEN_ID] if self.add_bos and add_special_tokens else []
        for w in text.split():
            m = _ID_WORD.match(w)
            if m and 0 < int(m.group(1)) < self.vocab_size:
                out.append(int(m.group(1)))
            else:
                out.append(1 + zlib.crc32(w.encode()) % (self.vocab_size - 1))
        return out

    def decode(self, ids) -> str:
        return " ".join(f"t{i}" for i in ids)


def sim_engine(config: SchedulerConfig, cost: Cost, num_kv_blocks: int = 4096, block_size: int = 16,
               max_model_len: int = 16384, overhead: Cost | None = None, prior: StepCost | None = None,
               vocab_size: int = 1000, add_bos: bool = False) -> Engine:
    """``prior``: the step-time model's start-up estimate; by default the true cost of a step
    (what a perfect start-up estimate gives), which needs ``cost`` and ``overhead`` to be StepCosts.
    ``add_bos``: prompts get a BOS token, as the profiled model's tokenizer gives them."""
    clock = VirtualClock()
    if prior is None:
        parts = [c for c in (cost, overhead) if c is not None]
        if not all(isinstance(c, StepCost) for c in parts):
            raise ValueError("prior: a cost that is not a StepCost needs a StepCost prior for the step-time model")
        prior = StepCost(*(sum(v) for v in zip(*(c.vector() for c in parts))),  # type: ignore[attr-defined]
                         knee=cost.knee)  # type: ignore[attr-defined]
    return Engine(config, SimRunner(clock, cost, vocab_size, overhead), SimTokenizer(vocab_size, add_bos),
                  KVLayout(num_kv_blocks, block_size), max_model_len, clock=clock, step_prior=prior)
