"""Server commands for `tandem compare --server` and `tandem tune --server-cmd`: placeholders filled
per trial, and engine presets that turn tandem's knob names into another engine's flags.

A command is split like a shell would split it (``shlex``) but run without one, so each word is
filled on its own: ``{port}``, ``{model}`` and any SchedulerConfig field (``{max_num_seqs}``, ...),
which takes the trial's value or else the field's default. A preset appends, for every knob the
trial sets, that engine's flag, unless the command already carries the knob as a placeholder; the
port flag and the engine's metrics switch are added when the command lacks them.

The flags were checked against: vLLM 0.19 (`vllm serve`), SGLang's server arguments as of
2026 (`python -m sglang.launch_server`), llama.cpp's `llama-server` at commit 0c1e570, and tandem
itself. A user who needs anything else writes the full command without ``--engine``."""

from __future__ import annotations

import dataclasses
import re
import shlex
import string
from dataclasses import dataclass, field
from typing import Any

from tandem.bench.config_keys import ROUTING_KEYS
from tandem.config import SchedulerConfig, ServerConfig

KNOBS = tuple(f.name for f in dataclasses.fields(SchedulerConfig)) + ROUTING_KEYS
"""The scheduler's settings, and a replicated tandem server's (only tandem's preset has flags for those)."""
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(SchedulerConfig)}
_DEFAULTS.update({f.name: f.default for f in dataclasses.fields(ServerConfig) if f.name in ROUTING_KEYS})


@dataclass(frozen=True)
class Preset:
    name: str
    checked: str
    """The engine version the flag names were checked against."""
    flags: dict[str, tuple[str, ...]]
    """knob -> the flags that carry its value (llama-server's batch is two: -b and -ub)."""
    policies: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """policy value -> the flags that select it; a policy missing here is refused."""
    always: tuple[str, ...] = ()
    """Flags every command gets (the metrics endpoint) unless it has them."""
    port_flag: str = "--port"
    metrics: str = ""
    """What /metrics exports that bench reads (and which switch turns it on)."""
    skip_default: dict[str, Any] = field(default_factory=dict)
    """knob -> a value the engine takes by default and may refuse when given explicitly."""

    def has(self, knob: str) -> bool:
        return knob in self.flags or (knob == "policy" and bool(self.policies))


PRESETS = {
    "vllm": Preset(
        "vllm", "vLLM 0.19.0",
        {"max_num_batched_tokens": ("--max-num-batched-tokens",), "max_num_seqs": ("--max-num-seqs",),
         "long_prefill_token_threshold": ("--long-prefill-token-threshold",),
         # vLLM wants max_long_partial_prefills <= max_num_partial_prefills: both carry the value
         "max_long_partial_prefills": ("--max-num-partial-prefills", "--max-long-partial-prefills")},
        {"chunked": ("--enable-chunked-prefill",), "prefill-first": ("--no-enable-chunked-prefill",)},
        metrics="vllm:num_requests_running, vllm:num_requests_waiting, vllm:kv_cache_usage_perc, "
                "vllm:prefix_cache_queries_total / _hits_total (always on)",
        # 0.19's V1 engine fails to start with more than one partial prefill; 1 is its default
        skip_default={"max_long_partial_prefills": 1}),
    "sglang": Preset(
        "sglang", "SGLang server arguments (docs.sglang.io, 2026)",
        {"max_num_batched_tokens": ("--chunked-prefill-size",), "max_num_seqs": ("--max-running-requests",)},
        # mixed chunks put a prefill chunk into the decode batch, as tandem's chunked policy does
        {"chunked": ("--enable-mixed-chunk",), "prefill-first": ()},
        always=("--enable-metrics",),
        metrics="sglang:num_running_reqs, sglang:num_queue_reqs, sglang:token_usage (with --enable-metrics)"),
    "llama-server": Preset(
        "llama-server", "llama.cpp llama-server, commit 0c1e570",
        # -b is the logical batch (tokens per decode call), -ub the physical one; equal, they are
        # one step's token budget
        {"max_num_batched_tokens": ("-b", "-ub"), "max_num_seqs": ("-np",)},
        # continuous batching (on by default) mixes prompt chunks with decoding slots
        {"chunked": ()},
        always=("--metrics",),
        metrics="llamacpp:requests_processing, llamacpp:requests_deferred (with --metrics)"),
    "tandem": Preset(
        "tandem", "tandem (this tree)",
        {k: ("--" + k.replace("_", "-"),) for k in KNOBS if k != "policy"},
        {p: ("--policy", p) for p in ("static", "prefill-first", "chunked")},
        metrics="tandem:* (running, waiting, KV usage, MFU/MBU, busy fraction, recomputed and prefix-cache "
                "counters; always on)"),
}
ENGINES = tuple(PRESETS)


def placeholders(command: str) -> set[str]:
    """The ``{name}`` fields in a command."""
    names = set()
    for word in shlex.split(command):
        for _, name, _, _ in string.Formatter().parse(word):
            if name is not None:
                names.add(name)
    return names


def check_command(command: str, preset: Preset | None) -> None:
    """Refuse unknown placeholders before any server starts."""
    if not command.strip():
        raise ValueError("server command: empty")
    try:
        names = placeholders(command)
    except ValueError as exc:
        raise ValueError(f"server command {command!r}: {exc}") from None
    unknown = names - {"port", "model", *KNOBS}
    if unknown:
        raise ValueError(f"server command: unknown placeholder {{{sorted(unknown)[0]}}}; known: {{port}}, {{model}} "
                         f"and the scheduler settings ({', '.join(KNOBS)})")
    if preset is None and "port" not in names:
        raise ValueError("server command: needs a {port} placeholder (or --engine, which adds the port flag)")


def _value(v: Any) -> str:
    if isinstance(v, bool):
        return str(v).lower()
    return f"{v:g}" if isinstance(v, float) else str(v)


def render(command: str, overrides: dict[str, Any], port: int, model: str | None = None,
           preset: Preset | None = None) -> list[str]:
    """The argv of one trial: ``command`` with its placeholders filled and, with a preset, the
    trial's knobs as that engine's flags."""
    check_command(command, preset)
    names = placeholders(command)
    if "model" in names and not model:
        raise ValueError("server command: uses {model}, so --model is required")
    values = {**_DEFAULTS, **overrides, "port": port, "model": model or ""}
    argv = [word.format_map({k: _value(v) if v is not None else "" for k, v in values.items()})
            for word in shlex.split(command)]
    if preset is None:
        return argv
    if preset.port_flag not in argv and "port" not in names:
        argv += [preset.port_flag, str(port)]
    for knob in sorted(overrides, key=_order):
        value = overrides[knob]
        if knob in names or value is None or (knob != "policy" and value in (0, "")):
            continue
        if knob == "policy":
            if value not in preset.policies:
                raise ValueError(f"policy: engine {preset.name} has no {value!r} policy "
                                 f"(it has {', '.join(preset.policies) or 'none'})")
            argv += preset.policies[value]
            continue
        if knob not in preset.flags:
            raise ValueError(f"{knob}: engine {preset.name} has no such setting (it has "
                             f"{', '.join(k for k in KNOBS if preset.has(k))})")
        if preset.skip_default.get(knob) == value:
            continue
        for flag in preset.flags[knob]:
            argv += [flag, _value(value)]
    argv += [f for f in preset.always if f not in argv]
    return argv


_FIRST = ("policy", "max_num_batched_tokens", "max_num_seqs")


def _order(knob: str) -> tuple:
    return (_FIRST.index(knob) if knob in _FIRST else len(_FIRST), knob)


def command_line(argv: list[str]) -> str:
    return shlex.join(argv)


def tunable(command: str, preset: Preset | None) -> set[str]:
    """The knobs a search may vary: the preset's, else those the command has placeholders for."""
    if preset is not None:
        return {k for k in KNOBS if preset.has(k)}
    return placeholders(command) & set(KNOBS)


def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip("-")[:60] or "server"
