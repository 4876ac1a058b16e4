"""What one step computes: the scheduler's output and the runner's answer.

This is the whole contract between the scheduling core and the model runner.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.core.request import Request, TokenLogprob


@dataclass
class ScheduledChunk:
    """Compute KV for positions ``[start, start + num_tokens)`` of ``request``."""

    request: Request
    start: int
    num_tokens: int
    block_table: list[int]
    samples: bool = field(init=False)
    """The chunk reaches the request's last token, so the step samples its next token."""
    is_decode: bool = field(init=False)
    """One token of a request that already has output (not a prompt or a recompute)."""

    def __post_init__(self) -> None:
        # Fixed at scheduling time: the request grows once the step's token is appended.
        self.samples = self.end == self.request.num_tokens
        self.is_decode = self.num_tokens == 1 and self.samples and self.request.num_output_tokens > 0

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def token_ids(self) -> list[int]:
        return self.request.token_slice(self.start, self.end)


@dataclass
class SchedulerOutput:
    step_id: int
    chunks: list[ScheduledChunk]
    preempted_ids: list[str] = field(default_factory=list)
    finished_ids: list[str] = field(default_factory=list)
    """Requests that ended since the previous step: the runner drops their state."""

    @property
    def num_decode_tokens(self) -> int:
        return sum(1 for c in self.chunks if c.is_decode)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks if not c.is_decode)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def kind(self) -> str:
        """'prefill' (prefill-only), 'decode' (decode-only), 'mixed' or 'idle'."""
        prefill, decode = self.num_prefill_tokens, self.num_decode_tokens
        if prefill and decode:
            return "mixed"
        if prefill:
            return "prefill"
        return "decode" if decode else "idle"

    @property
    def is_empty(self) -> bool:
        return not self.chunks


@dataclass
class SampledToken:
    token_id: int
    logprob: TokenLogprob | None = None


@dataclass
class RunnerOutput:
    sampled: dict[str, SampledToken]
    """One entry per chunk that samples, keyed by request id."""
    forward_seconds: float = 0.0
    """Time inside the model's forward pass and output layer; the rest of a step (scheduling, batch
    and metadata building, sampling, detokenization) is the engine's overhead."""
