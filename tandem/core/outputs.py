"""What the engine reports: one ``RequestOutput`` per request that changed in a step, and one
``StepStats`` per step (the record that the server's metrics, the trace and the benchmarks read)."""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.core.request import RequestTiming, TokenLogprob
from tandem.core.step import StepSizing


@dataclass(frozen=True)
class ChunkStat:
    """One scheduled chunk of a step, as recorded: KV computed for ``[start, start + num_tokens)``."""

    request_id: str
    start: int
    num_tokens: int
    is_decode: bool
    samples: bool
    num_recomputed_tokens: int = 0
    """Of ``num_tokens``, those computed before (recomputation after a preemption)."""


@dataclass
class StepStats:
    step_id: int
    start: float
    duration: float
    forward_seconds: float
    kind: str
    num_prefill_tokens: int
    num_decode_tokens: int
    num_seqs: int
    kv_blocks_used: int
    kv_blocks_total: int
    num_preempted: int
    num_waiting: int
    num_running: int
    error: str | None = None
    chunks: tuple[ChunkStat, ...] = ()
    kv_blocks_cached: int = 0
    """Blocks holding a reusable prefix block (held or evictable) after the step."""
    num_recomputed_tokens: int = 0
    """Of ``num_prefill_tokens``, those recomputed after a preemption rather than prefilled first-time."""
    num_cache_queries: int = 0
    """Tokens of the requests admitted in this step, each looked up in the prefix cache (0 with it off)."""
    num_cached_tokens: int = 0
    """Of those, the tokens reused from the prefix cache instead of computed."""
    num_generated: int | None = None
    """Tokens the step produced (``None``: every sampled chunk's, the step had no failure); a
    step that failed for some requests produced only the others'."""
    predicted_seconds: float | None = None
    """The step-time model's prediction of ``duration``, made before the step ran."""
    sizing: StepSizing | None = None
    """Under an ITL target: the target T, the noise margin and what set the step's prompt work
    (``StepSizing.limit``); None when no target applied."""

    @property
    def num_sampled(self) -> int:
        return sum(1 for c in self.chunks if c.samples)

    def spans(self) -> list[tuple[int, int]]:
        """(start position, tokens) of each chunk: what a cost model needs of the step."""
        return [(c.start, c.num_tokens) for c in self.chunks]


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    delta_text: str
    delta_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    timing: RequestTiming
    logprobs: list[TokenLogprob] = field(default_factory=list)
    error: str | None = None
    text_offsets: list[int] = field(default_factory=list)
    """Per output token, where its text begins in ``text`` (characters); filled when the request
    asked for logprobs, which are what report them (``text_offset``)."""
    user: str = ""
    """The request's user (fair sharing's tenant; "" anonymous)."""
    num_cached_tokens: int = 0
    """Prompt tokens taken from the prefix cache (OpenAI's ``usage.prompt_tokens_details.cached_tokens``)."""
