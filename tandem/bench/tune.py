"""`tandem tune`: find the chunked-prefill settings with the highest goodput that meet latency SLOs.

The search is coarse-to-fine over chunk size (``max_num_batched_tokens``) and ``max_num_seqs``:
every other chunk size at three batch limits, then a hill climb over the neighbours of the best
point, then the long-prompt caps around it; finally the best candidates are measured again and
judged on the median of their runs, to guard against a lucky run on a noisy machine.

A configuration *meets the SLOs* when its p99 TTFT and p99 ITL are within them; its *goodput*
counts completed requests per second whose own TTFT and TPOT are within them. Among configurations
that meet the SLOs the highest goodput wins (ties: higher output throughput); if none does, the
nearest miss (smallest worst ratio of measured to allowed latency) is reported as such.

Given an ITL SLO, the search also tries ITL targets instead of a budget (``target_itl_ms`` at
fractions of the SLO, with the largest chunk size as the step budget when nothing decodes, at the
best batch limit the budget search found): the target policy and the best fixed budget are judged
by the same rule, and the report says which of the two the recommendation is. Trials run with the
engine's defaults for every knob not searched, as the printed command would, the default ITL
target (``itl_target_factor``) included; ``--fixed itl_target_factor=0`` searches pure fixed budgets.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Sequence

from tandem.bench.repeats import median_summary
from tandem.config import SchedulerConfig

DEFAULT_CHUNKS = (32, 64, 128, 256, 512, 1024, 2048)
DEFAULT_SEQS = (4, 8, 16, 32, 64)


@dataclass(frozen=True)
class SLO:
    ttft_p99_ms: float | None = None
    itl_p99_ms: float | None = None

    def validate(self) -> None:
        for name in ("ttft_p99_ms", "itl_p99_ms"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                raise ValueError(f"{name}: must be > 0, got {v}")
        if self.ttft_p99_ms is None and self.itl_p99_ms is None:
            raise ValueError("slo: give at least one of the TTFT and ITL objectives")

    def goodput_args(self) -> list[str]:
        out = []
        if self.ttft_p99_ms:
            out.append(f"ttft:{self.ttft_p99_ms}")
        if self.itl_p99_ms:
            out.append(f"tpot:{self.itl_p99_ms}")
        return out

    def worst_ratio(self, s: dict) -> float:
        ratios = []
        if self.ttft_p99_ms:
            ratios.append(s["p99_ttft_ms"] / self.ttft_p99_ms)
        if self.itl_p99_ms:
            ratios.append(s["p99_itl_ms"] / self.itl_p99_ms)
        return max(r if not math.isnan(r) else math.inf for r in ratios)


@dataclass
class Trial:
    overrides: dict[str, Any]
    runs: list[dict] = field(default_factory=list)

    @property
    def summary(self) -> dict:
        """The median of each metric over the runs."""
        return median_summary(self.runs)

    def key(self) -> tuple:
        return tuple(sorted(self.overrides.items()))

    @property
    def error(self) -> str | None:
        """Why a launched server's run failed (it did not start, died, or hung), if one did."""
        return next((r["server_error"] for r in self.runs if r.get("server_error")), None)


def rank(trial: Trial, slo: SLO) -> tuple:
    s = trial.summary
    feasible = s["failed"] == 0 and not trial.error and slo.worst_ratio(s) <= 1.0
    if feasible:
        return (1, _num(s["request_goodput"]), _num(s["output_throughput"]))
    return (0, -slo.worst_ratio(s), _num(s["output_throughput"]))


def _num(x) -> float:
    return -math.inf if x is None or (isinstance(x, float) and math.isnan(x)) else x


def is_feasible(trial: Trial, slo: SLO) -> bool:
    return rank(trial, slo)[0] == 1


def pareto(trials: list[Trial]) -> list[Trial]:
    """Not dominated on (higher output throughput, lower p99 TTFT, lower p99 ITL)."""
    def vec(t: Trial):
        s = t.summary
        return (-_num(s["output_throughput"]), s["p99_ttft_ms"], s["p99_itl_ms"])

    front = []
    for t in trials:
        v = vec(t)
        if not any(all(a <= b for a, b in zip(vec(o), v)) and vec(o) != v for o in trials):
            front.append(t)
    return sorted(front, key=lambda t: -_num(t.summary["output_throughput"]))


@dataclass
class TuneResult:
    best: Trial
    feasible: bool
    trials: list[Trial]
    front: list[Trial]
    command: str


def tune(
    measure: Callable[[dict[str, Any]], dict],
    slo: SLO,
    chunks: Sequence[int] = DEFAULT_CHUNKS,
    seqs: Sequence[int] = DEFAULT_SEQS,
    repeats: int = 2,
    max_trials: int = 30,
    try_long_caps: bool = True,
    base_command: str = "tandem serve",
    log: Callable[[str], None] = lambda _: None,
    targets: Sequence[float] = (),
    fixed: dict[str, Any] | None = None,
    render: Callable[[dict[str, Any]], str] | None = None,
) -> TuneResult:
    """``targets``: ITL targets (ms) to try beside the budgets; ``fixed``: settings every trial
    gets (e.g. ``{"fairness": "vtc"}``); ``render``: the command line of a configuration
    (default: ``tandem serve`` flags after ``base_command``)."""
    slo.validate()
    chunks, seqs, targets = sorted(set(chunks)), sorted(set(seqs)), sorted(set(targets))
    trials: dict[tuple, Trial] = {}
    # the budget search leaves room for every target to be tried
    budget_trials = max(1, max_trials - len(targets))

    def run(overrides: dict[str, Any], limit: int = budget_trials) -> Trial:
        overrides = {"policy": "chunked", **(fixed or {}), **overrides}
        t = Trial(overrides)
        if t.key() in trials:
            return trials[t.key()]
        if len(trials) >= limit:
            return None  # type: ignore[return-value]
        t.runs.append(measure(overrides))
        trials[t.key()] = t
        s = t.summary
        log(f"{_label(overrides)}: {s['output_throughput']:.1f} tok/s, TTFT p99 {s['p99_ttft_ms']:.0f} ms, "
            f"ITL p99 {s['p99_itl_ms']:.0f} ms, goodput {_num(s['request_goodput']):.3f} req/s"
            + (" (meets SLOs)" if is_feasible(t, slo) else "") + (f" FAILED: {t.error}" if t.error else ""))
        return t

    def best_of() -> Trial:
        return max(trials.values(), key=lambda t: rank(t, slo))

    # 1. coarse: every other chunk size (keeping both ends) at a small, middle and large batch limit
    coarse_chunks = sorted(set(chunks[::2]) | {chunks[-1]})
    coarse_seqs = sorted({seqs[0], seqs[len(seqs) // 2], seqs[-1]})
    for c in coarse_chunks:
        for n in coarse_seqs:
            run({"max_num_batched_tokens": c, "max_num_seqs": n})
    # 2. fine: hill-climb over grid neighbours of the best point
    while True:
        best = best_of()
        c = best.overrides["max_num_batched_tokens"]
        n = best.overrides["max_num_seqs"]
        ci, ni = chunks.index(c), seqs.index(n)
        for dc, dn in ((-1, 0), (1, 0), (0, -1), (0, 1)):
            if 0 <= ci + dc < len(chunks) and 0 <= ni + dn < len(seqs):
                run({"max_num_batched_tokens": chunks[ci + dc], "max_num_seqs": seqs[ni + dn]})
        if best_of() is best or len(trials) >= budget_trials:
            break
    # 3. the long-prompt caps around the best point
    best = best_of()
    if try_long_caps:
        c = best.overrides["max_num_batched_tokens"]
        if c >= 32:
            run({**{k: v for k, v in best.overrides.items() if k != "policy"},
                 "long_prefill_token_threshold": c // 2, "max_long_partial_prefills": 1})
    # 4. ITL targets instead of a budget: the largest chunk size is then only the step's size
    # when nothing decodes (fast TTFT), while the target sizes prefill beside running streams
    budget_best = best_of()
    for target in targets:
        run({"max_num_batched_tokens": chunks[-1], "max_num_seqs": budget_best.overrides["max_num_seqs"],
             "target_itl_ms": target}, limit=max_trials)
    # 5. measure the leaders again; judge them on their medians
    leaders = sorted(trials.values(), key=lambda t: rank(t, slo), reverse=True)[:2]
    for t in leaders:
        while len(t.runs) < repeats:
            t.runs.append(measure(t.overrides))
            log(f"re-measured {_label(t.overrides)}: {t.summary['output_throughput']:.1f} tok/s (median)")
    best = best_of()
    all_trials = sorted(trials.values(), key=lambda t: rank(t, slo), reverse=True)
    return TuneResult(best, is_feasible(best, slo), all_trials, pareto(all_trials),
                      render(best.overrides) if render else serve_command(base_command, best.overrides))


def tune_over(deployments: list[dict[str, Any]], tune_one: Callable[[dict[str, Any]], TuneResult], slo: SLO,
              render: Callable[[dict[str, Any]], str] | None, base_command: str) -> TuneResult:
    """One search per deployment (replica count and routing: e.g. {"replicas": 2, "routing":
    "prefix-aware"}, or {} for a single server), merged: every trial ranked together, the best
    of all recommended."""
    results = [tune_one(d) for d in deployments]
    if len(results) == 1:
        return results[0]
    seen: dict[tuple, Trial] = {}
    for r in results:
        for t in r.trials:
            seen.setdefault(t.key(), t)
    trials = sorted(seen.values(), key=lambda t: rank(t, slo), reverse=True)
    best = trials[0]
    return TuneResult(best, is_feasible(best, slo), trials, pareto(trials),
                      render(best.overrides) if render else serve_command(base_command, best.overrides))


def _label(o: dict[str, Any]) -> str:
    text = f"chunk={o.get('max_num_batched_tokens')} seqs={o.get('max_num_seqs')}"
    if o.get("target_itl_ms"):
        text = f"target-itl={o['target_itl_ms']:g}ms " + text
    if o.get("long_prefill_token_threshold"):
        text += f" long-cap={o['long_prefill_token_threshold']}x{o.get('max_long_partial_prefills')}"
    for key, value in o.items():
        if key not in _COMMAND_ORDER and key != "policy" and value not in (None, ""):
            text += f" {key}={value}"
    return text


def is_target(trial: Trial) -> bool:
    return bool(trial.overrides.get("target_itl_ms"))


def best_by_kind(result: TuneResult, slo: SLO) -> dict[str, Trial]:
    """The best fixed-budget trial and the best ITL-target trial (where any was tried)."""
    out = {}
    for kind, pick in (("budget", lambda t: not is_target(t)), ("target", is_target)):
        tried = [t for t in result.trials if pick(t)]
        if tried:
            out[kind] = max(tried, key=lambda t: rank(t, slo))
    return out


_COMMAND_ORDER = ("max_num_batched_tokens", "max_num_seqs", "target_itl_ms", "target_ttft_ms",
                  "long_prefill_token_threshold", "max_long_partial_prefills")


_DEFAULTS = {f.name: f.default for f in fields(SchedulerConfig)}


def _shown(key: str, value: Any) -> bool:
    """Unset values are left out; a zero only where it is the default (``--itl-target-factor 0``
    turns the default ITL target off: it must be in the command)."""
    if value is None or value == "" or value is False:
        return False
    return value != 0 or _DEFAULTS.get(key, 0) != 0


def serve_command(base: str, overrides: dict[str, Any]) -> str:
    parts = [base]
    keys = ["policy", *_COMMAND_ORDER, *sorted(set(overrides) - set(_COMMAND_ORDER) - {"policy"})]
    for key in keys:
        value = overrides.get(key)
        if _shown(key, value):
            parts.append(f"--{key.replace('_', '-')} {value:g}" if isinstance(value, float)
                         else f"--{key.replace('_', '-')} {value}")
    return " ".join(parts)
