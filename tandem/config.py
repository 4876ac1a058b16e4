"""Every knob of the engine, in one place.

Each field carries its help text in ``metadata``; the CLI builds its flags from these
dataclasses (see ``tandem.cli_args``), so a default or a description lives here only.
``validate()`` raises ``ValueError`` naming the offending field.

This module imports no torch: the scheduling core and a simulator use it too. Longer than 300
lines: every knob lives here by design, so one file holds all defaults and help texts.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Sequence

from tandem.core.fairness import FAIRNESS_REGISTRY
from tandem.core.policies import POLICY_REGISTRY
from tandem.core.routing import ROUTING_POLICIES, check_routing
from tandem.ops.modes import KERNEL_MODES

POLICIES = tuple(POLICY_REGISTRY)  # the registry is the one list; this is its CLI view
FAIRNESS = tuple(FAIRNESS_REGISTRY)
DTYPES = ("auto", "float32", "bfloat16")
DEVICES = ("auto", "cpu", "cuda")
QUANTIZATIONS = ("auto", "none", "int8", "w8a8", "int4")


def _help(text: str, **extra: Any) -> dict[str, Any]:
    return {"help": text, **extra}


@dataclass(frozen=True)
class SchedulerConfig:
    policy: str = field(
        default="chunked",
        metadata=_help(
            "scheduling policy: 'static' (a batch runs to completion, nobody joins), "
            "'prefill-first' (continuous batching, whole-prompt prefill steps pause decodes), "
            "'chunked' (one token budget per step: decodes first, prompt chunks fill the rest)",
            choices=POLICIES,
        ),
    )
    max_num_seqs: int = field(default=32, metadata=_help("maximum number of requests in a batch"))
    max_num_batched_tokens: int = field(
        default=512,
        metadata=_help(
            "token budget of one step; for 'chunked' this is the chunk size, the lever between "
            "TTFT and stream smoothness; for 'prefill-first' it bounds a prefill step (a longer "
            "prompt runs alone); 'static' prefills its whole batch at once"
        ),
    )
    long_prefill_token_threshold: int = field(
        default=0,
        metadata=_help(
            "chunked: a prompt longer than this many tokens is 'long' and gets at most this many "
            "tokens per step (the per-request chunk cap); 0 disables"
        ),
    )
    max_long_partial_prefills: int = field(
        default=0,
        metadata=_help(
            "chunked: at most this many long prompts prefill at once, so short prompts can pass "
            "them; 0 means no cap"
        ),
    )
    fairness: str = field(
        default="fcfs",
        metadata=_help(
            "order of admission within one priority level: 'fcfs' (earliest arrival first), 'vtc' "
            "(fair sharing between users: the user with the least weighted service so far goes "
            "first; users are named by the request's 'user' field or the X-Tandem-User header)",
            choices=FAIRNESS,
        ),
    )
    vtc_prefill_weight: float = field(
        default=1.0, metadata=_help("vtc: service counted per prompt token computed (recomputation is free)")
    )
    vtc_decode_weight: float = field(default=2.0, metadata=_help("vtc: service counted per output token"))
    target_itl_ms: float | None = field(
        default=None,
        metadata=_help(
            "chunked: while streams decode, size each step's prefill share so the step's predicted time "
            "(the online step-time model) stays within this many ms, at least one KV block of prefill per "
            "step; the full --max-num-batched-tokens when nothing decodes; a request's own target_itl_ms "
            "may tighten it; None or 0 turns it off"
        ),
    )
    target_ttft_ms: float | None = field(
        default=None,
        metadata=_help(
            "chunked: a prompt predicted to miss its first token within this many ms of arrival takes a "
            "larger prefill share than --target-itl-ms allows, if that share can still meet it (one that "
            "cannot keeps the ITL share); a request's own target_ttft_ms replaces it; None or 0 turns it off"
        ),
    )
    itl_target_factor: float = field(
        default=3.5,
        metadata=_help(
            "chunked, when no --target-itl-ms applies: while streams decode, the ITL target is this many "
            "times the decode step of a full batch (--max-num-seqs streams at the running ones' mean context, "
            "as timed at start-up; at least --min-target-itl-ms), so streams stay smooth by default and the target scales "
            "with the machine; 0 turns it off (a fixed --max-num-batched-tokens budget)"
        ),
    )
    itl_margin_share: float = field(
        default=0.005,
        metadata=_help(
            "chunked, with an ITL target: the share of inter-token gaps that may run over the target because "
            "steps take longer than predicted. Steps with prompt work are sized below the target by the matching "
            "quantile of their measured/predicted time (a margin learnt from the last 256 such steps), so "
            "measured gaps, not only predictions, stay within it at p99; 0 sizes steps to the target itself"
        ),
    )
    itl_overrun_share: float = field(
        default=0.009,
        metadata=_help(
            "chunked, with an ITL target: the share of recent inter-token gaps (the last 4096) that may run "
            "over the target. While those that did stay below that share, a step with prompts to compute takes the "
            "whole --max-num-batched-tokens instead of the target's share: a p99 target leaves one gap in 100, "
            "so 0.009 (the default) spends most of that on finishing prompts sooner; steps that ran over by "
            "misprediction count too; 0 keeps every step within the target"
        ),
    )
    max_pause_ms: float = field(
        default=10000.0,
        metadata=_help(
            "chunked, with an ITL target: when at least as many prompts wait as streams run and the overrun "
            "allowance (--itl-overrun-share, counting the gaps that ignore_eos or min_tokens guarantee the "
            "requests still produce) can pay one long gap per stream, the streams pause while the prompts "
            "prefill with the whole --max-num-batched-tokens; a pause ends at the first step this many ms "
            "after it began, or sooner; 0 never pauses"
        ),
    )
    min_target_itl_ms: float = field(
        default=20.0, metadata=_help("the tightest target_itl_ms a request may ask for (400 below)")
    )
    min_target_ttft_ms: float = field(
        default=100.0, metadata=_help("the tightest target_ttft_ms a request may ask for (400 below)")
    )
    enable_prefix_caching: bool = field(
        default=True,
        metadata=_help(
            "automatic prefix caching: full KV blocks are named by a hash of their tokens and everything "
            "before them, kept after their request ends until the memory is needed (least recently used "
            "first), and a new request starts its prefill after the longest run of them it shares"
        ),
    )
    step_model_window: int = field(
        default=256, metadata=_help("the step-time model is fitted on the last this many measured steps")
    )
    step_model_refit_every: int = field(
        default=16, metadata=_help("the step-time model is refitted every this many measured steps")
    )

    def validate(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy: must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        _positive_int("max_num_seqs", self.max_num_seqs)
        _positive_int("max_num_batched_tokens", self.max_num_batched_tokens)
        _non_negative_int("long_prefill_token_threshold", self.long_prefill_token_threshold)
        _non_negative_int("max_long_partial_prefills", self.max_long_partial_prefills)
        if self.fairness not in FAIRNESS:
            raise ValueError(f"fairness: must be one of {', '.join(FAIRNESS)}, got {self.fairness!r}")
        for name in ("vtc_prefill_weight", "vtc_decode_weight"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value < float("inf"):
                raise ValueError(f"{name}: must be a finite number >= 0, got {value!r}")
        if self.max_long_partial_prefills and not self.long_prefill_token_threshold:
            raise ValueError(
                "max_long_partial_prefills: needs long_prefill_token_threshold > 0 to tell "
                "which prompts are long"
            )
        for name in ("target_itl_ms", "target_ttft_ms"):
            value = getattr(self, name)
            if value is not None and not _finite(value, least=0.0):
                raise ValueError(f"{name}: must be a number of milliseconds >= 0 (0 or None: off), got {value!r}")
        if not _finite(self.itl_target_factor, least=0.0) or 0 < self.itl_target_factor < 1:
            raise ValueError(f"itl_target_factor: must be 0 (off) or >= 1 (a step may not be shorter than its "
                             f"decodes alone), got {self.itl_target_factor!r}")
        if not _finite(self.itl_margin_share, least=0.0) or self.itl_margin_share >= 0.5:
            raise ValueError(f"itl_margin_share: must be a share in [0, 0.5) of the inter-token gaps, "
                             f"got {self.itl_margin_share!r}")
        if not _finite(self.itl_overrun_share, least=0.0) or self.itl_overrun_share >= 0.5:
            raise ValueError(f"itl_overrun_share: must be a share in [0, 0.5) of the inter-token gaps, "
                             f"got {self.itl_overrun_share!r}")
        for name in ("max_pause_ms", "min_target_itl_ms", "min_target_ttft_ms"):
            if not _finite(getattr(self, name), least=0.0):
                raise ValueError(f"{name}: must be a number of milliseconds >= 0, got {getattr(self, name)!r}")
        _positive_int("step_model_window", self.step_model_window)
        _positive_int("step_model_refit_every", self.step_model_refit_every)


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = field(default=16, metadata=_help("tokens per KV-cache block"))
    num_kv_blocks: int | None = field(
        default=None,
        metadata=_help("number of KV-cache blocks; overrides --kv-cache-memory-gib when given"),
    )
    kv_cache_memory_gib: float = field(
        default=1.0, metadata=_help("memory budget of the KV cache in GiB (used when no block count)")
    )

    def validate(self) -> None:
        _positive_int("block_size", self.block_size)
        if self.num_kv_blocks is not None:
            _positive_int("num_kv_blocks", self.num_kv_blocks)
        if not isinstance(self.kv_cache_memory_gib, (int, float)) or self.kv_cache_memory_gib <= 0:
            raise ValueError(f"kv_cache_memory_gib: must be > 0, got {self.kv_cache_memory_gib!r}")


@dataclass(frozen=True)
class ModelConfig:
    model: str | None = field(
        default=None,
        metadata=_help(
            "a local Hugging Face model directory or a .gguf file; default: the embedded "
            "Gemma 3 270M (GGUF, converted once and cached)"
        ),
    )
    dtype: str = field(
        default="auto",
        metadata=_help(
            "weights and activations: 'auto' (float32 with int8 weights, whose kernels take float32; "
            "else bfloat16 on CUDA and on CPUs with bf16 support, else float32), 'float32', 'bfloat16'",
            choices=DTYPES,
        ),
    )
    device: str = field(
        default="auto", metadata=_help("'cpu', 'cuda', or 'auto' (cuda when present)", choices=DEVICES)
    )
    quantization: str = field(
        default="auto",
        metadata=_help(
            "weights: 'auto' (the fastest of the modes below on this machine whose measured accuracy "
            "is within budget; measured on the default model, so other models stay 'none'; see "
            "docs/performance.md); 'none' (as --dtype); 'int8' (weight-only int8 with a float32 scale per "
            "output row, for every linear layer and the embedding/output table; activations "
            "stay in --dtype; a quarter of float32's bytes for memory-bound decode); 'w8a8' "
            "(int8 weights as 'int8', and each layer's inputs rounded to int8 at run time, one "
            "scale per 32 values, multiplied in integers: faster prefill and large batches, at "
            "a small accuracy cost); 'int4' (weight-only 4-bit, a float16 scale per 32 input "
            "values of each output row, every linear layer and the embedding/output table: "
            "0.56 bytes per weight, for faster memory-bound decode at a larger accuracy cost); "
            "all CPU only",
            choices=QUANTIZATIONS,
        ),
    )
    max_model_len: int | None = field(
        default=None,
        metadata=_help("context length (prompt + output); default: min(model's, 8192)"),
    )
    threads: int | None = field(
        default=None, metadata=_help("CPU threads for torch; default: the cores available")
    )
    cache_dir: str | None = field(
        default=None, metadata=_help("where converted models are cached; default: the user cache dir")
    )
    seed: int = field(default=0, metadata=_help("seed for requests that do not set their own"))
    grammar_cache_size: int = field(default=256, metadata=_help(
        "compiled structured-output grammars (JSON schemas, regexes, grammars) kept for reuse, least "
        "recently used evicted first"))
    kernels: str = field(
        default="auto",
        metadata=_help(
            "implementation of the hot ops: " + "; ".join(f"'{k}': {v}" for k, v in KERNEL_MODES.items()),
            choices=tuple(KERNEL_MODES),
        ),
    )

    def validate(self) -> None:
        if self.kernels not in KERNEL_MODES:
            raise ValueError(f"kernels: must be one of {', '.join(KERNEL_MODES)}, got {self.kernels!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype: must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.device not in DEVICES:
            raise ValueError(f"device: must be one of {', '.join(DEVICES)}, got {self.device!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"quantization: must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}"
            )
        if self.quantization not in ("none", "auto") and self.device == "cuda":
            raise ValueError(
                f"quantization: {self.quantization!r} runs on the CPU only; use --device cpu or --quantization none"
            )
        if self.max_model_len is not None:
            _positive_int("max_model_len", self.max_model_len)
        if self.threads is not None:
            _positive_int("threads", self.threads)
        _positive_int("grammar_cache_size", self.grammar_cache_size)
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ValueError(f"seed: must be an integer, got {self.seed!r}")


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)

    SECTIONS = ("model", "scheduler", "cache")

    def validate(self) -> None:
        self.model.validate()
        self.scheduler.validate()
        self.cache.validate()

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "EngineConfig":
        """Build from flat keyword arguments (``LLM(policy=..., block_size=...)``)."""
        parts: dict[str, dict[str, Any]] = {name: {} for name in cls.SECTIONS}
        owners = {f.name: section for section in cls.SECTIONS for f in dataclasses.fields(_SECTION_TYPES[section])}
        for key, value in kwargs.items():
            if key not in owners:
                raise ValueError(f"{key}: unknown engine option")
            parts[owners[key]][key] = value
        config = cls(**{section: _SECTION_TYPES[section](**values) for section, values in parts.items()})
        config.validate()
        return config

    def flat(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for section in self.SECTIONS:
            out.update(dataclasses.asdict(getattr(self, section)))
        return out


_SECTION_TYPES: dict[str, type] = {"model": ModelConfig, "scheduler": SchedulerConfig, "cache": CacheConfig}


def _positive_int(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name}: must be a positive integer, got {value!r}")


def _finite(value: Any, least: float) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and least <= value < float("inf")


def _non_negative_int(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name}: must be a non-negative integer, got {value!r}")


@dataclass(frozen=True)
class ServerConfig:
    host: str = field(default="127.0.0.1", metadata=_help("address to listen on"))
    port: int = field(default=8000, metadata=_help("port to listen on"))
    served_model_name: str | None = field(
        default=None, metadata=_help("model name clients use; default: the model's path or 'gemma-3-270m'")
    )
    api_key: str | None = field(
        default=None,
        metadata=_help("require 'Authorization: Bearer KEY' on /v1 routes, /tokenize and /detokenize "
                       "(or set TANDEM_API_KEY)"),
    )
    allowed_hosts: Sequence[str] = field(
        default=(),
        metadata=_help(
            "a Host header name to accept, any port (repeatable; '*' accepts any); default: only "
            "localhost, 127.0.0.1 and [::1] when --host is a loopback address (against DNS rebinding), "
            "any when bound elsewhere; other hosts get 400",
            action="append",
        ),
    )
    max_waiting: int = field(
        default=256, metadata=_help("bound of the waiting queue; beyond it requests get 429 with Retry-After")
    )
    max_request_bytes: int = field(default=1 << 20, metadata=_help("largest accepted request body (413 beyond)"))
    tokenizer_threads: int = field(
        default=2,
        metadata=_help("worker threads that tokenize prompts, render chat and detokenize, off the event loop"),
    )
    trace: str | None = field(
        default=None, metadata=_help("write the step timeline as Chrome trace JSON to this file on shutdown")
    )
    peak_flops: float | None = field(
        default=None, metadata=_help("peak FLOP/s for utilization metrics; default: measured at start-up")
    )
    peak_memory_bandwidth: float | None = field(
        default=None, metadata=_help("peak memory bytes/s for utilization metrics; default: measured at start-up")
    )
    shutdown_timeout: float = field(default=30.0, metadata=_help(
        "on SIGTERM/SIGINT new requests get 503 and running ones have this many seconds to finish; then every "
        "open stream ends with an error event and [DONE] (a second signal ends them at once)"))
    header_timeout: float = field(default=10.0, metadata=_help(
        "seconds a connection has to send a request's complete headers, counted from its start or the request's "
        "first byte; then it is closed (with 408 if part of a request came)"))
    body_timeout: float = field(default=30.0, metadata=_help(
        "seconds a request's body has to arrive in full once its headers have; then 408 and the connection "
        "is closed (a client trickling its body cannot hold a connection and a handler forever)"))
    keep_alive_timeout: float = field(default=5.0, metadata=_help("seconds an idle keep-alive connection stays open"))
    max_connections: int = field(default=1000, metadata=_help(
        "open connections beyond this get 503 (with Connection: close) for their requests"))
    stream_write_timeout: float = field(default=10.0, metadata=_help(
        "a stream whose client takes no data for this many seconds (the send blocks) is aborted, its KV freed "
        "and its connection closed"))
    admission_queue: int = field(default=256, metadata=_help(
        "requests that may wait, in arrival order, for room in the waiting queue (--max-waiting) before 429; "
        "0 refuses at once when the waiting queue is full"))
    admission_timeout: float = field(default=10.0, metadata=_help(
        "seconds a request may wait in the admission queue before 429 with Retry-After"))
    metrics_top_users: int = field(default=10, metadata=_help(
        "per-user series in /metrics for this many users (most tokens first); the rest are summed as user=\"other\""))
    replicas: int = field(default=1, metadata=_help(
        "engine replicas behind one endpoint, on Ray Serve (docs/scale-out.md); each gets its share of the "
        "CPU threads (--threads divided among them) or one GPU; 1 serves from this process without Ray"))
    routing: str = field(default="prefix-aware", metadata=_help(
        "how requests are spread over replicas: round-robin, least-loaded (fewest tokens of work), or "
        "prefix-aware (the replica holding the longest cached prefix unless it is overloaded)",
        choices=ROUTING_POLICIES))
    routing_imbalance_tokens: int = field(default=4096, metadata=_help(
        "prefix-aware: a replica with the prefix is passed over when its tokens of work exceed the "
        "least-loaded replica's by more than this"))
    routing_stats_period: float = field(default=0.5, metadata=_help(
        "seconds between each replica's load and prefix-cache reports to the router"))
    ray_address: str | None = field(default=None, metadata=_help(
        "join this Ray cluster (e.g. ray://head:10001, or auto for the one `ray start` runs here) and serve from "
        "it, even with one replica; 'local' starts a local instance as --replicas > 1 does without this flag; "
        "default: a local Ray instance for the server's lifetime, with --replicas > 1"))

    def resolved_api_key(self) -> str | None:
        """The key clients must send: --api-key, else TANDEM_API_KEY, else none."""
        return self.api_key or os.environ.get("TANDEM_API_KEY") or None

    def validate(self) -> None:
        if not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ValueError(f"port: must be in [0, 65535], got {self.port!r}")
        _positive_int("max_waiting", self.max_waiting)
        _positive_int("max_request_bytes", self.max_request_bytes)
        _positive_int("tokenizer_threads", self.tokenizer_threads)
        for host in self.allowed_hosts:
            if not isinstance(host, str) or not host.strip():
                raise ValueError(f"allowed_hosts: each must be a non-empty host name, got {host!r}")
        for name in ("peak_flops", "peak_memory_bandwidth"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, (int, float)) or value <= 0):
                raise ValueError(f"{name}: must be > 0, got {value!r}")
        for name in ("header_timeout", "body_timeout", "keep_alive_timeout", "stream_write_timeout",
                     "shutdown_timeout", "admission_timeout"):
            value, least = getattr(self, name), 0 if name in ("shutdown_timeout", "admission_timeout") else 1e-9
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value >= least:
                raise ValueError(f"{name}: must be {'>= 0' if least == 0 else '> 0'}, got {value!r}")
        _positive_int("max_connections", self.max_connections)
        _non_negative_int("admission_queue", self.admission_queue)
        _non_negative_int("metrics_top_users", self.metrics_top_users)
        _positive_int("replicas", self.replicas)
        check_routing(self.routing, self.routing_imbalance_tokens)
        value = self.routing_stats_period
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
            raise ValueError(f"routing_stats_period: must be > 0, got {value!r}")
        if self.trace and (self.replicas > 1 or self.ray_address is not None):
            raise ValueError("trace: the step trace is written by a single-process server; it is not available "
                             "with --replicas or --ray-address")
        if self.ray_address is not None and (not isinstance(self.ray_address, str) or not self.ray_address.strip()):
            raise ValueError(f"ray_address: must be a non-empty address, got {self.ray_address!r}")
