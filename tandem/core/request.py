"""A request: its tokens, its progress and its timing.

Progress is kept as counters, not as a phase flag: ``num_computed_tokens`` of ``num_tokens``
(prompt + output) have their KV in the cache. A step schedules the next slice of uncomputed
tokens; when the slice reaches the end, the step samples one new token. A prefill, a prefill
chunk, a decode and a recompute after preemption are all the same operation.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from tandem.core.sampling_params import SamplingParams
from tandem.latency import itls


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    LENGTH = "length"  # max_tokens or the context length reached
    STOP = "stop"  # EOS, a stop token id or a stop string
    ABORT = "abort"  # cancelled by the caller
    ERROR = "error"  # the step that carried it failed


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class RequestTiming:
    """Wall-clock times (seconds, the engine clock) of one request's life."""

    arrival: float
    first_scheduled: float | None = None
    first_token: float | None = None
    token_times: list[float] = field(default_factory=list)
    finish: float | None = None
    num_preemptions: int = 0

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled is None else self.first_scheduled - self.arrival

    @property
    def e2e(self) -> float | None:
        return None if self.finish is None else self.finish - self.arrival

    @property
    def itls(self) -> list[float]:
        return itls(self.token_times)


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    max_total_tokens: int
    """prompt + output may not exceed this (the context length)."""
    eos_token_ids: tuple[int, ...] = ()
    priority: int = 0
    prompt: str | None = None
    user: str = ""
    """The tenant fair sharing counts service for ("" is the anonymous user)."""
    cache_salt: str | None = None
    """Requests share cached prefix blocks only with requests of the same salt (``prefix_cache``)."""

    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    arrival_index: int = 0
    """Order of arrival, for FCFS ties; set by the scheduler."""
    num_cached_ever: int = 0
    """The most tokens that ever had KV at once: positions below it that are computed again
    after a preemption are recomputation, not first-time prefill."""
    num_recomputed_tokens: int = 0
    num_cached_tokens: int = 0
    """Prompt tokens whose KV came from the prefix cache when the request was first admitted."""
    block_hashes: list[bytes] = field(default_factory=list, repr=False)
    """Hashes of the request's full blocks so far (computed as the prefix cache needs them)."""

    def __post_init__(self) -> None:
        self.timing = RequestTiming(arrival=self.arrival_time)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def num_new_prompt_tokens(self) -> int:
        """Prompt tokens whose KV was never computed (a recompute does not count)."""
        return self.new_prompt_in(self.num_computed_tokens, self.num_prompt_tokens)

    def new_prompt_in(self, start: int, end: int) -> int:
        """How many of positions ``[start, end)`` are prompt tokens computed for the first time."""
        return max(0, min(end, self.num_prompt_tokens) - max(start, self.num_cached_ever))

    def recomputed_in(self, start: int, end: int) -> int:
        """How many of positions ``[start, end)`` had their KV computed before."""
        return max(0, min(end, self.num_cached_ever) - start)

    @property
    def is_prefilling(self) -> bool:
        """True while more than the last token lacks KV (a prompt, or a recompute)."""
        return self.num_uncomputed_tokens > 1

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def token_slice(self, start: int, end: int) -> list[int]:
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]

    @property
    def guaranteed_output_tokens(self) -> int:
        """Output tokens this request will produce unless it is aborted: ``min_tokens``, or with
        ``ignore_eos`` and nothing else that may end it early (stop strings or ids, a grammar) all of
        ``max_tokens`` that fit in the context."""
        p = self.params
        whole = p.ignore_eos and not p.stop and not p.stop_token_ids and p.constraint is None
        room = max(0, self.max_total_tokens - self.num_prompt_tokens)
        return min(p.max_tokens if whole else p.min_tokens, room)

    @property
    def guaranteed_gaps_left(self) -> int:
        """Inter-token gaps it will still produce unless aborted (a token's gap is to the one before)."""
        return max(0, self.guaranteed_output_tokens - max(self.num_output_tokens, 1))

    @property
    def max_tokens_needed(self) -> int:
        """The most KV slots this request can ever need."""
        return min(self.num_prompt_tokens + self.params.max_tokens, self.max_total_tokens)

    def sort_key(self) -> tuple[int, int]:
        """FCFS with an optional integer priority: lower value first, then earlier arrival."""
        return (self.priority, self.arrival_index)
