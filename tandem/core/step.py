"""What one step computes: the scheduler's output and the runner's answer.

This is the whole contract between the scheduling core and the model runner, and it is plain
data: the runner is told request ids, token ids, positions, block tables and sampling parameters,
never a live ``Request``, so nothing it reads can change under it while the step runs and either
side can be replaced (the simulator replaces the runner).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.core.request import TokenLogprob
from tandem.core.sampling_params import SamplingParams


@dataclass(frozen=True)
class KVLayout:
    """The paged KV cache's geometry, shared by the block allocator (ids) and the runner (tensors).

    A request's block table maps its token position ``p`` to cache slot
    ``table[p // block_size] * block_size + p % block_size``."""

    num_blocks: int
    block_size: int

    def __post_init__(self) -> None:
        for name in ("num_blocks", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name}: must be a positive integer, got {value!r}")

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)


@dataclass(frozen=True)
class ScheduledChunk:
    """Compute KV for positions ``[start, start + num_tokens)`` of one request."""

    request_id: str
    start: int
    token_ids: tuple[int, ...]
    """The tokens at those positions."""
    block_table: tuple[int, ...]
    """The request's cache blocks, covering at least ``end`` positions."""
    sampling: SamplingParams
    """How to sample the next token (read only when ``samples``)."""
    samples: bool
    """The chunk reaches the request's last token, so the step samples its next token."""
    is_decode: bool
    """One token of a request that already has output (not a prompt or a recompute)."""
    num_prompt_tokens: int
    """Prompt length of the request: positions below it are prompt, the rest output."""
    num_recomputed_tokens: int = 0
    """Of these tokens, how many had their KV computed before (a preempted request's recompute)."""
    prompt_token_ids: tuple[int, ...] | None = None
    """The whole prompt, sent with a request's first sampling chunk where its sampling reads the
    prompt (``repetition_penalty``): with a prefix cache the runner never sees a cached prefix."""

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)

    @property
    def positions(self) -> range:
        return range(self.start, self.end)


SIZING_LIMITS = ("itl", "ttft", "overrun", "pause", "none")
"""What may set a step's prompt work under an ITL target (``StepSizing.limit``)."""


@dataclass(frozen=True)
class StepSizing:
    """Why a step under an ITL target carried the prompt work it did (``target_budget.PrefillShare``)."""

    target_seconds: float
    """T: the tightest ITL target of the step's decodes (a request's, the engine's, or the default's
    ``itl_target_factor`` times a full batch)."""
    margin: float
    """The share of T that prompt work was sized to (the noise margin; 1: none)."""
    overrun: bool = False
    """The overrun allowance let the step take the whole token budget instead of its ITL share."""
    ttft_tokens: int = 0
    """Prompt tokens granted beyond the ITL share so that prompts meet their TTFT deadlines."""
    prompts: bool = True
    """A prompt asked for tokens in the step (False: only decodes to run, nothing to size)."""
    paused: int = 0
    """Streams the step paused so that a burst of prompts took the whole token budget
    (``burst_pause``); 0: it decoded every running stream."""
    pause_end: str = ""
    """Why the burst pause just before this step ended (``burst_pause.END_REASONS``); "": none did."""

    @property
    def limit(self) -> str:
        """What set the prefill share: 'pause', 'overrun', 'ttft', 'itl', or 'none' (no prompt asked for any)."""
        if not self.prompts:
            return "none"
        return "pause" if self.paused else "overrun" if self.overrun else "ttft" if self.ttft_tokens else "itl"


@dataclass(frozen=True)
class SchedulerOutput:
    step_id: int
    chunks: tuple[ScheduledChunk, ...]
    preempted_ids: tuple[str, ...] = ()
    finished_ids: tuple[str, ...] = ()
    """Requests that ended since the previous step: the runner drops their state."""
    sizing: StepSizing | None = None
    """How the policy sized the step's prompt work under an ITL target (None: no target applied)."""

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
    def num_recomputed_tokens(self) -> int:
        return sum(c.num_recomputed_tokens for c in self.chunks)

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
    sampled: dict[str, SampledToken] = field(default_factory=dict)
    """One entry per chunk that samples, keyed by request id."""
    forward_seconds: float = 0.0
    """Time inside the model's forward pass and output layer; the rest of a step (scheduling, batch
    and metadata building, sampling, detokenization) is the engine's overhead."""
