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
from dataclasses import dataclass, field, replace
from typing import Any, Sequence

from tandem.core.constraint import Constraint

GREEDY_BELOW = 1e-5
"""Temperatures below this are greedy (vLLM's threshold)."""

MAX_LOGIT_BIAS = 300
"""OpenAI's bound on ``logit_bias`` entries."""
MAX_BAD_WORDS, MAX_BAD_WORD_CHARS = 128, 256

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
    presence_penalty: float = field(default=0.0, metadata=_help(
        "subtracted from the logit of every token the output already holds; in [-2, 2]"))
    frequency_penalty: float = field(default=0.0, metadata=_help(
        "subtracted from a token's logit once per time the output already holds it; in [-2, 2]"))
    repetition_penalty: float = field(default=1.0, metadata=_help(
        "> 0: logits of tokens in the prompt or output are divided by it where positive, multiplied where "
        "negative; 1 disables"))
    logit_bias: dict[int, float] | None = field(default=None, metadata=_help(
        f"TOKEN_ID=BIAS pairs: BIAS in [-100, 100] is added to that token's logit; at most {MAX_LOGIT_BIAS}",
        nargs="+"))
    min_tokens: int = field(default=0, metadata=_help(
        "end-of-sequence and stop_token_ids cannot be sampled, nor stop strings end the output, before this "
        "many output tokens"))
    min_p: float = field(default=0.0, metadata=_help(
        "drop tokens whose probability is below min_p times the most likely one's; in [0, 1]"))
    bad_words: Sequence[str] = field(default=(), metadata=_help(
        "a word that may not be generated (repeatable)", action="append"))
    bad_words_token_ids: tuple[tuple[int, ...], ...] = field(default=(), repr=False, metadata=_help(
        "derived: bad_words tokenized (``with_tokenizer``)"))
    constraint: Constraint | None = field(default=None, metadata=_help(
        "structured outputs: the grammar every output token must follow (``tandem.core.constraint``); the "
        "output ends where the grammar does, even with ignore_eos"))

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = (self.stop,)
        self.stop = tuple(self.stop)
        self.stop_token_ids = tuple(self.stop_token_ids)
        if isinstance(self.bad_words, str):
            self.bad_words = (self.bad_words,)
        self.bad_words = tuple(self.bad_words)
        if isinstance(self.logit_bias, (list, tuple)):  # the command line's TOKEN_ID=BIAS pairs
            self.logit_bias = _parse_bias_pairs(self.logit_bias)
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
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2 <= value <= 2:
                raise ValueError(f"{name}: must be a number in [-2, 2], got {value!r}")
        if not _is_number(self.repetition_penalty) or not 0 < self.repetition_penalty < math.inf:
            raise ValueError(f"repetition_penalty: must be a finite number > 0, got {self.repetition_penalty!r}")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p: must be a number in [0, 1], got {self.min_p!r}")
        # not checked against max_tokens here: a front end may lower max_tokens to the room left
        # in the context after this check (max_tokens then wins)
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens: must be an integer >= 0, got {self.min_tokens!r}")
        self._validate_logit_bias()
        if len(self.bad_words) > MAX_BAD_WORDS or not all(
                isinstance(w, str) and w.strip() and len(w) <= MAX_BAD_WORD_CHARS for w in self.bad_words):
            raise ValueError(f"bad_words: at most {MAX_BAD_WORDS} non-blank strings of at most "
                             f"{MAX_BAD_WORD_CHARS} characters, got {self.bad_words!r:.200}")
        if self.constraint is not None and not isinstance(self.constraint, Constraint):
            raise ValueError(f"constraint: expected a Constraint, got {type(self.constraint).__name__}")

    def _validate_logit_bias(self) -> None:
        bias = self.logit_bias
        if bias is None:
            return
        if not isinstance(bias, dict) or len(bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias: must map at most {MAX_LOGIT_BIAS} token ids to biases")
        for token, value in bias.items():
            if not _is_int(token) or token < 0:
                raise ValueError(f"logit_bias: keys must be token ids (integers >= 0), got {token!r}")
            if not _is_number(value) or not -100 <= value <= 100:
                raise ValueError(f"logit_bias: the bias of token {token} must be a number in [-100, 100], got {value!r}")

    def with_tokenizer(self, tokenizer: Any) -> "SamplingParams":
        """These parameters checked against the model's vocabulary, with ``bad_words`` tokenized
        (a copy where anything is added: the same parameters may serve several prompts)."""
        vocab = tokenizer.vocab_size
        for token in self.logit_bias or {}:
            if token >= vocab:
                raise ValueError(f"logit_bias: token id {token} is outside the vocabulary [0, {vocab})")
        params = self
        ends = tuple(t for t in tokenizer.eos_token_ids if t not in self.stop_token_ids)
        if self.constraint is not None and self.ignore_eos and ends:
            # a finished grammar allows nothing but end-of-sequence: ignore_eos would have the
            # request generate EOS tokens to max_tokens, so the grammar's end stops it as a stop token
            params = replace(params, stop_token_ids=tuple(self.stop_token_ids) + ends)
        if not self.bad_words:
            return params
        words: list[tuple[int, ...]] = []
        for word in self.bad_words:
            # as the word starts the output and as it follows a space: BPE vocabularies spell them apart
            for text in (word.strip(), " " + word.strip()):
                ids = tuple(tokenizer.encode(text, add_special_tokens=False))
                if ids and ids not in words:
                    words.append(ids)
        return replace(params, bad_words_token_ids=tuple(words))

    @property
    def uses_penalties(self) -> bool:
        """Any of the penalties that read the token history."""
        return (self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.repetition_penalty != 1)

    def processes_logits(self, num_output_tokens: int) -> bool:
        """Whether the next token's logits change before sampling (``tandem.runner.penalties``);
        ``min_p`` does not count: it only narrows a random draw, nor ``constraint``, whose mask the
        sampler applies on its own (``tandem.runner.grammar``)."""
        return (self.uses_penalties or bool(self.logit_bias) or bool(self.bad_words_token_ids)
                or num_output_tokens < self.min_tokens)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


TARGET_FIELDS = ("target_itl_ms", "target_ttft_ms")
"""Per-request latency targets; the engine's bounds on them are checked where the engine's
configuration is known (``tandem.core.target_budget.check_request_targets``). ``tandem generate``
sets the engine's own targets (its scheduler flags of the same names), not these."""

CLI_DEFAULTS: dict[str, Any] = {"max_tokens": 64, "temperature": 0.0}
"""``tandem generate``'s defaults where they differ from the fields' own."""


def _parse_bias_pairs(pairs: Sequence[str]) -> dict[int, float]:
    out: dict[int, float] = {}
    for pair in pairs:
        token, sep, bias = str(pair).partition("=")
        try:
            out[int(token)] = float(bias)
        except ValueError:
            raise ValueError(f"logit_bias: expected TOKEN_ID=BIAS, got {pair!r}") from None
        if not sep:
            raise ValueError(f"logit_bias: expected TOKEN_ID=BIAS, got {pair!r}")
    return out


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
