"""The latency frontier of a comparison: ITL p99 against TTFT p99, one point per configuration,
with each ITL target as a vertical line — where an ITL target policy and fixed step budgets can be
judged on one picture (a configuration *meets* a target when its ITL p99 is left of the line; of
those, lower is better). A chunked configuration without ``target_itl_ms`` whose
``itl_target_factor`` is not 0 (the engine's default) is steered by the default target: it is
drawn apart (a diamond) and is not one of the fixed budgets a target is judged against. Drawn
when the configurations differ in ``target_itl_ms`` or in ``max_num_batched_tokens``."""

from __future__ import annotations

import math
from pathlib import Path

from tandem.bench.evaluate import Evaluation
from tandem.config import SchedulerConfig

PLOT = "itl_ttft_frontier.png"
_KEYS = ("target_itl_ms", "max_num_batched_tokens")


def wanted(evaluations: list[Evaluation]) -> bool:
    return len(evaluations) > 1 and any(
        len({e.candidate.overrides.get(k) for e in evaluations}) > 1 for k in _KEYS)


def targets(evaluations: list[Evaluation]) -> list[float]:
    return sorted({float(t) for e in evaluations if (t := e.candidate.overrides.get("target_itl_ms"))})


_DEFAULT = SchedulerConfig()


def default_target(e: Evaluation) -> bool:
    """Chunked with no ITL target of its own and the default target on (``itl_target_factor`` not 0,
    the engine's default unless the configuration sets it)."""
    o = e.candidate.overrides
    return (not o.get("target_itl_ms") and o.get("policy", _DEFAULT.policy) == "chunked"
            and o.get("itl_target_factor", _DEFAULT.itl_target_factor) != 0)


def fixed(e: Evaluation) -> bool:
    """A fixed budget: no ITL target, explicit or default, sizes its prefill."""
    return not e.candidate.overrides.get("target_itl_ms") and not default_target(e)


def _point(e: Evaluation) -> tuple[float, float]:
    return e.summary["p99_itl_ms"], e.summary["p99_ttft_ms"]


def _finite_values(*values) -> bool:
    return all(isinstance(v, (int, float)) and math.isfinite(v) for v in values)


def _finite(e: Evaluation) -> bool:
    return _finite_values(*_point(e))


def plot_frontier(evaluations: list[Evaluation], path: Path) -> None:
    import matplotlib.pyplot as plt  # the Agg backend is chosen by tandem.bench.report
    from matplotlib.ticker import FuncFormatter, LogLocator

    from tandem.bench.report import save_figure

    fig, ax = plt.subplots(figsize=(8, 5.5))
    lines = targets(evaluations)
    for e in filter(_finite, evaluations):
        x, y = _point(e)
        target = e.candidate.overrides.get("target_itl_ms")
        meets = any(x <= t for t in lines) if target is None else x <= target
        marker, size = ("*", 160) if target else ("D", 70) if default_target(e) else ("o", 50)
        ax.scatter([x], [y], marker=marker, s=size, zorder=3,
                   color="tab:green" if meets or not lines else "tab:red")
        ax.annotate(e.candidate.name, (x, y), textcoords="offset points", xytext=(6, 4), fontsize=8)
    for t in lines:
        ax.axvline(t, color="gray", linestyle="--", zorder=1)
        ax.annotate(f"target {t:g} ms", (t, 1), xycoords=("data", "axes fraction"), xytext=(3, -12),
                    textcoords="offset points", fontsize=8, color="gray")
    ax.set_xlabel("ITL p99 (ms)")
    ax.set_ylabel("TTFT p99 (ms)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    for axis in (ax.xaxis, ax.yaxis):
        axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))  # labels within one decade too
        axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}"))
        axis.set_minor_formatter(FuncFormatter(lambda v, _: ""))
    ax.set_title("ITL p99 vs TTFT p99 (lower left is better; stars: ITL target policy; diamonds: the "
                 "default target; green: within a target)", fontsize=9)
    ax.grid(alpha=0.3, which="both")
    save_figure(fig, path)


def _judge(points: list[tuple[Evaluation, float, float]]) -> list[tuple[Evaluation, float, float, float, list]]:
    """``points``: (configuration, ITL p99, TTFT p99). Per ITL target and configuration that has it:
    (configuration, target, ITL p99, TTFT p99, the fixed-budget points that meet the target)."""
    out = []
    budgets = [p for p in points if fixed(p[0])]
    for t in targets([p[0] for p in points]):
        for e, itl, ttft in points:
            if float(e.candidate.overrides.get("target_itl_ms") or 0) == t:
                out.append((e, t, itl, ttft, [f for f in budgets if f[1] <= t]))
    return out


def verdict(evaluations: list[Evaluation]) -> list[str]:
    """Per ITL target: does the target configuration meet it, and how does its TTFT p99 compare
    with every fixed-budget configuration that also meets it (on medians, for repeated runs); with
    repeats, also in how many rounds it won when each round is judged on its own runs."""
    out = []
    for e, t, itl, ttft, meeting in _judge([(e, *_point(e)) for e in evaluations if _finite(e)]):
        line = (f"- target {t:g} ms, **{e.candidate.name}**: ITL p99 {itl:,.0f} ms "
                f"({'meets' if itl <= t else 'misses'} the target), TTFT p99 {ttft:,.0f} ms; ")
        if not meeting:
            line += "no fixed budget meets the target."
        else:
            best = min(meeting, key=lambda f: f[2])
            lower = all(ttft < f[2] for f in meeting)
            line += (f"{len(meeting)} fixed budget(s) meet it, the best TTFT p99 among them "
                     f"{best[2]:,.0f} ms ({best[0].candidate.name}): the target's TTFT p99 is "
                     f"{'lower than every one' if lower else 'not lower than all'} of them.")
        out.append(line)
    out += _rounds(evaluations)
    return out


def _rounds(evaluations: list[Evaluation]) -> list[str]:
    """Repeated runs: round i is every configuration's i-th run; per target configuration, the rounds
    in which it met the target and had a lower TTFT p99 than every fixed budget meeting it."""
    n = min((len(e.runs) for e in evaluations if e.runs), default=0)
    if n < 2 or any(not e.runs for e in evaluations):
        return []
    wins: dict[tuple[str, float], int] = {}
    for i in range(n):
        points = [(e, e.runs[i]["p99_itl_ms"], e.runs[i]["p99_ttft_ms"]) for e in evaluations]
        points = [p for p in points if _finite_values(*p[1:])]
        for e, t, itl, ttft, meeting in _judge(points):
            won = itl <= t and all(ttft < f[2] for f in meeting)
            wins[(e.candidate.name, t)] = wins.get((e.candidate.name, t), 0) + won
    return [f"- target {t:g} ms, **{name}**, round by round: it met the target with a TTFT p99 lower than every "
            f"fixed budget that met it in {k} of {n} rounds." for (name, t), k in wins.items()]
