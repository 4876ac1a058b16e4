"""Sampling parameters: the one place that defines them, their defaults and their checks.

The defaults are OpenAI's (``max_tokens`` 16, ``temperature`` 1), which the HTTP server's
``/v1/completions`` uses as they are. Front ends that differ say so here and nowhere else:

- ``tandem generate``: ``CLI_DEFAULTS`` (greedy, a paragraph of output);
- ``/v1/chat/completions`` without ``max_tokens``: up to the end of the context, as OpenAI's chat
  API does (the server computes the room left).

A temperature below ``GREEDY_BELOW`` samples greedily, as vLLM does: dividing float32 logits by
a temperature that small overflows them (1e-40 is not even a normal float32), which would turn
the row into NaNs and the draw into token 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence


GREEDY_BELOW = 1e-5
"""Temperatures below this are greedy (vLLM's threshold)."""

SEED_MIN, SEED_MAX = -(1 << 63), (1 << 64) - 1
"""A seed is 64 bits, signed or unsigned: what the random generator accepts. The HTTP API takes
the signed range only (as vLLM does), which leaves room for the seeds derived per choice."""


def _help(text: str, **extra: Any) -> dict[str, Any]:
    return {"help": text, **extra}


@dataclass
class SamplingParams:
    max_tokens: int = field(default=16, metadata=_help("output tokens per prompt"))
    temperature: float = field(default=1.0, metadata=_help(f"0 (or below {GREEDY_BELOW:g}) is greedy"))
    top_p: float = field(default=1.0, metadata=_help("nucleus sampling: keep the smallest set of tokens with this mass"))
    top_k: int = field(default=-1, metadata=_help("keep the k most likely tokens; -1 disables"))
    seed: int | None = field(default=None, metadata=_help("seed of this request's random draws"))
    stop: Sequence[str] = field(default=(), metadata=_help("a stop string (repeatable)", action="append"))
    stop_token_ids: Sequence[int] = field(default=(), metadata=_help("token ids that end the output", nargs="+"))
    ignore_eos: bool = field(default=False, metadata=_help("keep generating past end-of-sequence"))
    logprobs: int | None = field(default=None, metadata=_help(
        "return the sampled token's logprob and this many top alternatives (0: sampled only)"))
    include_stop_str_in_output: bool = field(default=False, metadata=_help("keep the matched stop string in the text"))
    target_itl_ms: float | None = field(default=None, metadata=_help(
        "this request's inter-token latency target (ms); tightens the engine's --target-itl-ms for the steps "
        "it decodes in, never below --min-target-itl-ms"))
    target_ttft_ms: float | None = field(default=None, metadata=_help(
        "this request's time-to-first-token target (ms), replacing the engine's --target-ttft-ms; never below "
        "--min-target-ttft-ms"))

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = (self.stop,)
        self.stop = tuple(self.stop)
        self.stop_token_ids = tuple(self.stop_token_ids)
        self.validate()

    def validate(self) -> None:
        if not _is_int(self.max_tokens) or self.max_tokens <= 0:
            raise ValueError(f"max_tokens: must be a positive integer, got {self.max_tokens!r}")
        if not _is_number(self.temperature) or self.temperature < 0 or not math.isfinite(self.temperature):
            raise ValueError(f"temperature: must be a finite number >= 0, got {self.temperature!r}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < -1 or self.top_k == 0:
            raise ValueError(f"top_k: must be -1 (disabled) or a positive integer, got {self.top_k!r}")
        if self.seed is not None and (not _is_int(self.seed) or not SEED_MIN <= self.seed <= SEED_MAX):
            raise ValueError(f"seed: must be an integer in [-2**63, 2**64 - 1], got {self.seed!r}")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop: must be non-empty strings, got {self.stop!r}")
        if not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids: must be non-negative integers, got {self.stop_token_ids!r}")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= 20):
            raise ValueError(f"logprobs: must be an integer in [0, 20], got {self.logprobs!r}")
        for name in TARGET_FIELDS:
            value = getattr(self, name)
            if value is not None and (not _is_number(value) or not 0 < value < math.inf):
                raise ValueError(f"{name}: must be a number of milliseconds > 0, got {value!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


TARGET_FIELDS = ("target_itl_ms", "target_ttft_ms")
"""Per-request latency targets; the engine's bounds on them are checked where the engine's
configuration is known (``tandem.core.target_budget.check_request_targets``). ``tandem generate``
sets the engine's own targets (its scheduler flags of the same names), not these."""

CLI_DEFAULTS: dict[str, Any] = {"max_tokens": 64, "temperature": 0.0}
"""``tandem generate``'s defaults where they differ from the fields' own."""


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
