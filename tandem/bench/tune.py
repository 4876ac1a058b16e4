"""`tandem tune`: find the chunked-prefill settings with the highest goodput that meet latency SLOs.

The search is coarse-to-fine over chunk size (``max_num_batched_tokens``) and ``max_num_seqs``:
every other chunk size at three batch limits, then a hill climb over the neighbours of the best
point, then the long-prompt caps around it; finally the best candidates are measured again and
judged on the median of their runs, to guard against a lucky run on a noisy machine.

A configuration *meets the SLOs* when its p99 TTFT and p99 ITL are within them; its *goodput*
counts completed requests per second whose own TTFT and TPOT are within them. Among configurations
that meet the SLOs the highest goodput wins (ties: higher output throughput); if none does, the
nearest miss (smallest worst ratio of measured to allowed latency) is reported as such.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

DEFAULT_CHUNKS = (32, 64, 128, 256, 512, 1024, 2048)
DEFAULT_SEQS = (4, 8, 16, 32, 64)
KEYS = ("output_throughput", "total_token_throughput", "request_goodput", "median_ttft_ms", "p99_ttft_ms",
        "median_itl_ms", "p99_itl_ms", "p99_stall_ms", "completed", "failed")


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
        return {k: statistics.median(r.get(k) if r.get(k) is not None else math.nan for r in self.runs) for k in KEYS}

    def key(self) -> tuple:
        return tuple(sorted(self.overrides.items()))


def rank(trial: Trial, slo: SLO) -> tuple:
    s = trial.summary
    feasible = s["failed"] == 0 and slo.worst_ratio(s) <= 1.0
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
) -> TuneResult:
    slo.validate()
    chunks, seqs = sorted(set(chunks)), sorted(set(seqs))
    trials: dict[tuple, Trial] = {}

    def run(overrides: dict[str, Any]) -> Trial:
        overrides = {"policy": "chunked", **overrides}
        t = Trial(overrides)
        if t.key() in trials:
            return trials[t.key()]
        if len(trials) >= max_trials:
            return None  # type: ignore[return-value]
        t.runs.append(measure(overrides))
        trials[t.key()] = t
        s = t.summary
        log(f"{_label(overrides)}: {s['output_throughput']:.1f} tok/s, TTFT p99 {s['p99_ttft_ms']:.0f} ms, "
            f"ITL p99 {s['p99_itl_ms']:.0f} ms, goodput {_num(s['request_goodput']):.3f} req/s"
            + (" (meets SLOs)" if is_feasible(t, slo) else ""))
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
        if best_of() is best or len(trials) >= max_trials:
            break
    # 3. the long-prompt caps around the best point
    best = best_of()
    if try_long_caps:
        c = best.overrides["max_num_batched_tokens"]
        if c >= 32:
            run({**{k: v for k, v in best.overrides.items() if k != "policy"},
                 "long_prefill_token_threshold": c // 2, "max_long_partial_prefills": 1})
    # 4. measure the leaders again; judge them on their medians
    leaders = sorted(trials.values(), key=lambda t: rank(t, slo), reverse=True)[:2]
    for t in leaders:
        while len(t.runs) < repeats:
            t.runs.append(measure(t.overrides))
            log(f"re-measured {_label(t.overrides)}: {t.summary['output_throughput']:.1f} tok/s (median)")
    best = best_of()
    all_trials = sorted(trials.values(), key=lambda t: rank(t, slo), reverse=True)
    return TuneResult(best, is_feasible(best, slo), all_trials, pareto(all_trials),
                      serve_command(base_command, best.overrides))


def _label(o: dict[str, Any]) -> str:
    text = f"chunk={o.get('max_num_batched_tokens')} seqs={o.get('max_num_seqs')}"
    if o.get("long_prefill_token_threshold"):
        text += f" long-cap={o['long_prefill_token_threshold']}x{o.get('max_long_partial_prefills')}"
    return text


def serve_command(base: str, overrides: dict[str, Any]) -> str:
    parts = [base]
    for key in ("policy", "max_num_batched_tokens", "max_num_seqs", "long_prefill_token_threshold",
                "max_long_partial_prefills"):
        if overrides.get(key):
            parts.append(f"--{key.replace('_', '-')} {overrides[key]}")
    return " ".join(parts)


def write_tune_report(out: Path, result: TuneResult, slo: SLO, meta: dict) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from tandem.bench.report import save_figure

    out.mkdir(parents=True, exist_ok=True)

    def entry(t: Trial) -> dict:
        return {"config": t.overrides, "runs": len(t.runs), "meets_slos": is_feasible(t, slo), **t.summary}

    data = {**meta, "slo": {"ttft_p99_ms": slo.ttft_p99_ms, "itl_p99_ms": slo.itl_p99_ms},
            "best": entry(result.best), "meets_slos": result.feasible, "command": result.command,
            "pareto_front": [entry(t) for t in result.front], "trials": [entry(t) for t in result.trials]}
    (out / "tune.json").write_text(json.dumps(data, indent=1, default=str) + "\n")
    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    front = {t.key() for t in result.front}
    for ax, key, limit, title in ((axes[0], "p99_ttft_ms", slo.ttft_p99_ms, "p99 TTFT"),
                                  (axes[1], "p99_itl_ms", slo.itl_p99_ms, "p99 ITL")):
        for t in result.trials:
            s = t.summary
            on_front = t.key() in front
            ax.scatter([s["output_throughput"]], [s[key]], s=50 if on_front else 18,
                       color="tab:green" if is_feasible(t, slo) else "tab:red", marker="o" if on_front else "x")
            if on_front:
                ax.annotate(_label(t.overrides), (s["output_throughput"], s[key]), fontsize=7,
                            textcoords="offset points", xytext=(4, 4))
        b = result.best.summary
        ax.scatter([b["output_throughput"]], [b[key]], s=160, facecolors="none", edgecolors="black", label="chosen")
        if limit:
            ax.axhline(limit, color="gray", linestyle="--", label="SLO")
        ax.set_xlabel("output throughput (tokens/s)")
        ax.set_ylabel(f"{title} (ms)")
        ax.set_yscale("log")
        ax.set_title(f"{title} vs throughput: green meets the SLOs, circles are the Pareto front")
        ax.title.set_fontsize(9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    save_figure(fig, out / "pareto.png")
    b = result.best.summary
    verdict = ("meets the SLOs" if result.feasible else
               f"does NOT meet the SLOs: no configuration tried did; this is the nearest miss "
               f"(worst measured/allowed ratio {slo.worst_ratio(b):.2f})")
    md = [f"# Tuning: {meta.get('workload', '')}", "",
          f"SLOs: p99 TTFT <= {slo.ttft_p99_ms} ms, p99 ITL <= {slo.itl_p99_ms} ms. "
          f"{len(result.trials)} configurations measured ({sum(len(t.runs) for t in result.trials)} runs).", "",
          f"**Best: {_label(result.best.overrides)}** — {verdict}: {b['output_throughput']:.1f} output tok/s, "
          f"goodput {_num(b['request_goodput']):.3f} req/s, TTFT p99 {b['p99_ttft_ms']:.0f} ms, "
          f"ITL p99 {b['p99_itl_ms']:.0f} ms (medians of {len(result.best.runs)} runs).", "",
          "```bash", result.command, "```", "",
          "| configuration | runs | output tok/s | goodput req/s | TTFT p99 ms | ITL p99 ms | meets SLOs | Pareto |",
          "|---|---|---|---|---|---|---|---|"]
    for t in result.trials:
        s = t.summary
        md.append(f"| {_label(t.overrides)} | {len(t.runs)} | {s['output_throughput']:.1f} | "
                  f"{_num(s['request_goodput']):.3f} | {s['p99_ttft_ms']:.0f} | {s['p99_itl_ms']:.0f} | "
                  f"{'yes' if is_feasible(t, slo) else 'no'} | {'*' if t.key() in front else ''} |")
    md += ["", "![Pareto front](pareto.png)"]
    (out / "tune.md").write_text("\n".join(md) + "\n")
    return [out / "tune.json", out / "tune.md", out / "pareto.png"]
