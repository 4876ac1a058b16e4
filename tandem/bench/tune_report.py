"""The report of `tandem tune`: tune.json, tune.md (the verdict, every trial, the command line,
the budget-or-target recommendation) and pareto.png."""

from __future__ import annotations

import json
from pathlib import Path

from tandem.bench.tune import SLO, Trial, TuneResult, _label, _num, best_by_kind, is_feasible, is_target, rank


def write_tune_report(out: Path, result: TuneResult, slo: SLO, meta: dict) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from tandem.bench.report import save_figure

    out.mkdir(parents=True, exist_ok=True)

    def entry(t: Trial) -> dict:
        out = {"config": t.overrides, "runs": len(t.runs), "meets_slos": is_feasible(t, slo), **t.summary}
        logs = [r["server_log"] for r in t.runs if r.get("server_log")]
        if logs:  # a launched server's trial
            out.update(server_logs=logs, error=t.error)
        return out

    kinds = best_by_kind(result, slo)
    data = {**meta, "recommends": "target" if is_target(result.best) else "budget",
            **{f"best_{k}": entry(t) for k, t in kinds.items()}, "slo": {"ttft_p99_ms": slo.ttft_p99_ms, "itl_p99_ms": slo.itl_p99_ms},
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
        if any(t.summary[key] > 0 for t in result.trials):  # NaN compares false: every trial failed
            ax.set_yscale("log")
        ax.set_title(f"{title} vs throughput: green meets the SLOs, circles are the Pareto front")
        ax.title.set_fontsize(9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    save_figure(fig, out / "pareto.png")
    b = result.best.summary
    verdict = ("FAILED: every trial's server failed (see *Failed trials*), so this is no recommendation"
               if all(t.error for t in result.trials) else "meets the SLOs" if result.feasible else
               f"does NOT meet the SLOs: no configuration tried did; this is the nearest miss "
               f"(worst measured/allowed ratio {slo.worst_ratio(b):.2f})")
    md = [f"# Tuning{' (simulated search)' if meta.get('simulated') else ''}: {meta.get('workload', '')}", "",
          *([f"SIMULATED: every trial below ran on the simulator ({meta['simulated']}); the figures are "
             f"predictions. The real-engine confirmation follows the table.", ""] if meta.get("simulated") else []),
          f"SLOs: p99 TTFT <= {slo.ttft_p99_ms} ms, p99 ITL <= {slo.itl_p99_ms} ms. "
          f"{len(result.trials)} configurations measured ({sum(len(t.runs) for t in result.trials)} runs).", "",
          f"**Best: {_label(result.best.overrides)}** — {verdict}: {b['output_throughput']:.1f} output tok/s, "
          f"goodput {_num(b['request_goodput']):.3f} req/s, TTFT p99 {b['p99_ttft_ms']:.0f} ms, "
          f"ITL p99 {b['p99_itl_ms']:.0f} ms (medians of {len(result.best.runs)} runs).", "",
          *([f"LAUNCHED: every trial started `{meta['server_cmd']}` (engine preset {meta['engine']}"
             + (f", flags checked against {meta['engine_checked']}" if meta.get("engine_checked") else "")
             + "), measured it over HTTP and stopped it; logs are in `logs/`.", ""] if meta.get("launched") else []),
          "```bash", result.command, "```", "", *recommendation(result, slo),
          "| configuration | runs | output tok/s | goodput req/s | TTFT p99 ms | ITL p99 ms | meets SLOs | Pareto |",
          "|---|---|---|---|---|---|---|---|"]
    for t in result.trials:
        s = t.summary
        md.append(f"| {_label(t.overrides)} | {len(t.runs)} | {s['output_throughput']:.1f} | "
                  f"{_num(s['request_goodput']):.3f} | {s['p99_ttft_ms']:.0f} | {s['p99_itl_ms']:.0f} | "
                  f"{'yes' if is_feasible(t, slo) else 'no'} | {'*' if t.key() in front else ''} |")
    md += failed_trials(result)
    md += ["", "![Pareto front](pareto.png)"]
    (out / "tune.md").write_text("\n".join(md) + "\n")
    return [out / "tune.json", out / "tune.md", out / "pareto.png"]


def recommendation(result: TuneResult, slo: SLO) -> list[str]:
    """Where ITL targets were tried: the best fixed budget against the best target, and which one
    the verdict picked (the same rule as every trial: meets the SLOs, then goodput, then output
    throughput)."""
    kinds = best_by_kind(result, slo)
    if "target" not in kinds or "budget" not in kinds:
        return []

    def line(kind: str, t: Trial) -> str:
        s = t.summary
        return (f"- best {kind}: {_label(t.overrides)} — {'meets' if is_feasible(t, slo) else 'misses'} the SLOs; "
                f"TTFT p99 {s['p99_ttft_ms']:.0f} ms, ITL p99 {s['p99_itl_ms']:.0f} ms, "
                f"{s['output_throughput']:.1f} output tok/s, goodput {_num(s['request_goodput']):.3f} req/s")

    budget, target = kinds["budget"], kinds["target"]
    winner = "an ITL target" if rank(target, slo) > rank(budget, slo) else "a fixed budget"
    return ["## A budget or an ITL target", "", line("budget", budget), line("target", target), "",
            f"Recommended: **{winner}**.", ""]


def failed_trials(result: TuneResult) -> list[str]:
    """Launched servers that did not start, died or hung: the error and the log's last lines."""
    md = []
    for t in result.trials:
        for r in t.runs:
            if r.get("server_error"):
                md += [f"- {_label(t.overrides)}: {r['server_error']} (log: `{r['server_log']}`)", "", "  ```",
                       *("  " + line for line in (r.get("server_log_tail") or "").splitlines()), "  ```", ""]
    return ["", "## Failed trials", "", *md] if md else []
