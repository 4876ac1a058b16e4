"""The comparison report: a table per configuration, TTFT vs throughput, ITL timelines side by
side, and the prefill/decode token mix of every step over time; per-class and per-user tables and
the ITL/TTFT frontier where they apply (``breakdown``, ``frontier``)."""

from __future__ import annotations

import base64
import html
import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from tandem.bench import breakdown, frontier  # noqa: E402
from tandem.bench.evaluate import Evaluation  # noqa: E402
from tandem.bench.report import save_figure  # noqa: E402
from tandem.bench.results import results_json, row  # noqa: E402

PLOTS = ("ttft_vs_throughput.png", "itl_timelines.png", "step_mix.png")


def _f(v, digits=1) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "n/a"
    return f"{v:,.{digits}f}"


def table(evaluations: list[Evaluation]) -> str:
    lines = ["| configuration | output tok/s | total tok/s | TTFT p50 / p99 (ms) | ITL p50 / p99 (ms) | "
             "stall p99 (ms) | goodput (req/s) | MFU / MBU | preemptions | recomputed tokens | "
             "prefill computed / cached (tokens) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for e in evaluations:
        r = row(e)
        util = f"{_f(100 * r['mfu'])}% / {_f(100 * r['mbu'])}%" if r["mfu"] is not None else "n/a"
        lines.append(
            f"| {r['config']} | {_f(r['output_throughput'])} | {_f(r['total_token_throughput'])} | "
            f"{_f(r['median_ttft_ms'], 0)} / {_f(r['p99_ttft_ms'], 0)} | {_f(r['median_itl_ms'], 0)} / "
            f"{_f(r['p99_itl_ms'], 0)} | {_f(r['p99_stall_ms'], 0)} | {_f(r['request_goodput'], 3)} | {util} | "
            f"{_n(r['preemptions'])} | {_n(r['recomputed_tokens'])} | {r['prefill_tokens']:,} / {r['cached_tokens']:,} |")
    return "\n".join(lines)


def _positive(v) -> bool:
    return v is not None and not math.isnan(v) and v > 0


def _n(v) -> str:
    return "n/a" if v is None else f"{v:,}"


def servers_section(evaluations: list[Evaluation], meta: dict) -> list[str]:
    """Launched servers: each configuration's command and log, and why a failed one failed."""
    launched = [e for e in evaluations if e.server is not None]
    if not launched:
        return []
    engine = meta.get("engine")
    md = ["## Servers", "", "Each configuration was a server started for its run, warmed up, measured over HTTP "
          "and stopped" + (f"; engine preset `{engine}`, flags checked against {meta['engine_checked']}"
                           if meta.get("engine_checked") else "") + ".", ""]
    for e in launched:
        srv = e.server
        md += [f"- **{e.candidate.name}**" + (f" — FAILED: {srv['error']}" if srv["error"] else "") +
               f" (log: `{Path(srv['log']).name}`)", "", f"      {srv['command']}", ""]
        if srv.get("not_applied"):
            md += [f"  not applied (no placeholder in the command): {', '.join(srv['not_applied'])}", ""]
        if srv["error"]:
            md += ["  ```", *("  " + line for line in (srv["log_tail"] or "").splitlines()), "  ```", ""]
    return md


def replicas_section(evaluations: list[Evaluation]) -> list[str]:
    """Replicated simulations: where the router sent the requests, and how much of their prompts'
    full blocks the chosen replica's cache served."""
    rows = [e for e in evaluations if e.replicas is not None]
    if not rows:
        return []
    md = ["## Replicas", "",
          "Requests per replica, the router's reasons, and the prefix-hit share: of the prompts' full blocks, "
          "those the chosen replica's KV cache served at admission (the router's own expectation in brackets).", "",
          "| configuration | routing | requests per replica | reasons | prefix-hit share |", "|---|---|---|---|---|"]
    for e in rows:
        r = e.replicas
        reasons: dict[str, int] = {}
        for p in r["per_replica"]:
            for k, v in p["reasons"].items():
                reasons[k] = reasons.get(k, 0) + v
        hit = "n/a" if r["prefix_hit_share"] is None else \
            f"{100 * r['prefix_hit_share']:.0f}% ({100 * r['expected_share']:.0f}%)"
        md.append(f"| {e.candidate.name} | {r['routing']} | {' / '.join(map(str, r['requests_per_replica']))} | "
                  f"{', '.join(f'{k} {v}' for k, v in sorted(reasons.items()))} | {hit} |")
    return md + [""]


def repeats_section(evaluations: list[Evaluation]) -> list[str]:
    """Configurations that ran several times (``tandem.bench.repeats``): each run's headline figures."""
    repeated = [e for e in evaluations if e.runs]
    if not repeated:
        return []
    n = max(len(e.runs) for e in repeated)
    md = ["## Repeats", "",
          f"Each configuration ran {n} times, round by round (every configuration once, then again), so a slow "
          "spell of the machine falls on all of them alike. The tables above give each figure's median over the "
          "runs; per-class tables and the plots show the run whose TTFT p99 is the median one. Each run, in order:",
          "", "| configuration | output tok/s | TTFT p99 (ms) | ITL p99 (ms) |", "|---|---|---|---|"]
    for e in repeated:
        cells = [" / ".join(_f(r[key], digits) for r in e.runs)
                 for key, digits in (("output_throughput", 1), ("p99_ttft_ms", 0), ("p99_itl_ms", 0))]
        md.append(f"| {e.candidate.name} | " + " | ".join(cells) + " |")
    return md + [""]


def plot_ttft_vs_throughput(evaluations: list[Evaluation], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(8, 5))
    for e in evaluations:
        s = e.summary
        x = s["output_throughput"]
        ax.plot([x, x], [s["median_ttft_ms"], s["p99_ttft_ms"]], color="lightgray", zorder=1)
        p = ax.scatter([x], [s["median_ttft_ms"]], marker="o", zorder=2)
        ax.scatter([x], [s["p99_ttft_ms"]], marker="^", color=p.get_facecolor(), zorder=2)
        ax.annotate(e.candidate.name, (x, s["p99_ttft_ms"]), textcoords="offset points", xytext=(5, 5), fontsize=8)
    ax.set_xlabel("output throughput (tokens/s)")
    ax.set_ylabel("TTFT (ms): circle p50, triangle p99")
    if any(_positive(e.summary["p99_ttft_ms"]) for e in evaluations):  # not when every configuration failed
        ax.set_yscale("log")
    ax.set_title("TTFT vs throughput (right and low is better)")
    ax.grid(alpha=0.3)
    save_figure(fig, path)


def plot_itl_timelines(evaluations: list[Evaluation], path: Path) -> None:
    n = len(evaluations)
    fig, axes = plt.subplots(n, 1, figsize=(12, 2.4 * n), sharex=True, squeeze=False)
    top = max((g for e in evaluations for r in e.data.results if r.success for g in r.itls), default=1.0) * 1000
    for ax, e in zip(axes[:, 0], evaluations):
        xs, ys = [], []
        for r in e.data.results:
            if r.success:
                xs.extend(r.token_times[1:])
                ys.extend(g * 1000 for g in r.itls)
        ax.scatter(xs, ys, s=3, alpha=0.6)
        ax.set_ylim(0, top * 1.05)
        ax.set_ylabel("ITL (ms)")
        ax.set_title(e.candidate.name, fontsize=9, loc="left")
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("seconds since start (each dot: the gap before one token; high dots are stalls)")
    save_figure(fig, path)


def plot_step_mix(evaluations: list[Evaluation], path: Path) -> None:
    n = len(evaluations)
    fig, axes = plt.subplots(n, 1, figsize=(12, 2.4 * n), sharex=True, squeeze=False)
    for ax, e in zip(axes[:, 0], evaluations):
        if not e.steps:
            continue
        t0 = e.steps[0].start
        xs = [s.start - t0 for s in e.steps]
        widths = [max(s.duration, 1e-4) for s in e.steps]
        pre = [s.num_prefill_tokens for s in e.steps]
        dec = [s.num_decode_tokens for s in e.steps]
        ax.bar(xs, dec, width=widths, align="edge", color="tab:blue", label="decode tokens")
        ax.bar(xs, pre, width=widths, align="edge", bottom=dec, color="tab:orange", label="prefill tokens")
        ax.set_ylabel("tokens / step")
        ax.set_title(e.candidate.name, fontsize=9, loc="left")
        ax.grid(alpha=0.3)
    axes[0, 0].legend(loc="upper right", fontsize=8)
    axes[-1, 0].set_xlabel("seconds since start (bar width = step duration)")
    save_figure(fig, path)


def write_compare_report(out: Path, evaluations: list[Evaluation], meta: dict) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    (out / "compare.json").write_text(results_json(evaluations, {**meta, **breakdown.json_data(evaluations)}) + "\n")
    plot_ttft_vs_throughput(evaluations, out / PLOTS[0])
    plot_itl_timelines(evaluations, out / PLOTS[1])
    plots = list(PLOTS)
    if any(e.steps for e in evaluations):
        plot_step_mix(evaluations, out / PLOTS[2])
    else:  # launched servers: their steps are not seen from outside
        plots.remove(PLOTS[2])
    runs = meta.get("repeats", 1)
    md = [f"# Comparison{' (simulated)' if meta.get('simulated') else ''}: {meta['scenario']}", "",
          meta["description"], "",
          f"{meta['num_requests']} requests, the same for every configuration (seed {meta['seed']})"
          + (f"; every configuration ran {runs} times, figures are medians (see *Repeats*)." if runs > 1 else "."), ""]
    if meta.get("simulated"):
        md += [f"SIMULATED, not measured: the real scheduler on a virtual clock, steps priced by the "
               f"{meta['profile']}. Seconds are virtual.", ""]
    if meta.get("launched"):
        md += ["LAUNCHED: every configuration is a server process measured over HTTP (see *Servers* below); "
               "MFU/MBU, preemptions and the step mix are not seen from outside.", ""]
    md += [table(evaluations), ""]
    if meta.get("goodput_slos_ms"):
        md += ["Goodput SLOs: " + ", ".join(f"{k} <= {v:g} ms" for k, v in meta["goodput_slos_ms"].items()), ""]
    md += _extra_sections(evaluations, out, plots)
    md += replicas_section(evaluations)
    md += repeats_section(evaluations)
    md += servers_section(evaluations, meta)
    md += [f"![{p}]({p})" for p in plots]
    text = "\n".join(md) + "\n"
    (out / "compare.md").write_text(text)
    images = "".join(
        f'<h2>{html.escape(p[:-4].replace("_", " "))}</h2><img style="max-width:100%" '
        f'src="data:image/png;base64,{base64.b64encode((out / p).read_bytes()).decode()}">' for p in plots)
    body = html.escape("\n".join(md[: md.index(table(evaluations))]))
    rest = html.escape("\n".join(md[md.index(table(evaluations)) + 1: len(md) - len(plots)]))
    page = ("<!doctype html><html><head><meta charset='utf-8'><title>tandem compare</title>"
            "<style>body{font-family:sans-serif;max-width:1200px;margin:auto;padding:1em}"
            "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:4px 8px;text-align:right}"
            "td:first-child{text-align:left}</style></head><body>"
            f"<pre>{body}</pre>{_html_table(evaluations)}<pre>{rest}</pre>{images}</body></html>")
    (out / "compare.html").write_text(page)
    return [out / n for n in ("compare.json", "compare.md", "compare.html", *plots)]


def _extra_sections(evaluations: list[Evaluation], out: Path, plots: list[str]) -> list[str]:
    """Per-class and per-user tables where there are groups; the ITL/TTFT frontier (and its
    verdict per target) where configurations differ in budget or ITL target."""
    md = []
    for by, title in (("class", "Per class"), ("user", "Per user")):
        text = breakdown.table(evaluations, by)
        if text:
            md += [f"## {title}", "", text, ""]
    if frontier.wanted(evaluations):
        frontier.plot_frontier(evaluations, out / frontier.PLOT)
        plots.append(frontier.PLOT)
        lines = frontier.verdict(evaluations)
        if lines:
            md += ["## ITL target", "", *lines, ""]
    return md


def write_loads_index(out: Path, scenario, runs: dict[str, list[Evaluation]], simulated: str | None = None) -> Path:
    """The page of a scenario made of several loads: each load's main table and frontier verdict,
    linking to its own report. ``simulated``: the cost profile, when a simulator ran them."""
    out.mkdir(parents=True, exist_ok=True)
    md = [f"# Comparison{' (simulated)' if simulated else ''}: {scenario.name}", "", scenario.description, ""]
    if simulated:
        md += [f"SIMULATED, not measured: steps priced by the {simulated}.", ""]
    for load, evaluations in runs.items():
        md += [f"## {load}", "", f"[full report]({load}/compare.md)", "", table(evaluations), ""]
        md += frontier.verdict(evaluations) + [""]
        if frontier.wanted(evaluations):
            md += [f"![{load}]({load}/{frontier.PLOT})", ""]
    path = out / "compare.md"
    path.write_text("\n".join(md) + "\n")
    return path


def _html_table(evaluations: list[Evaluation]) -> str:
    lines = table(evaluations).splitlines()
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:]]
    th = "".join(f"<th>{html.escape(h)}</th>" for h in head)
    trs = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><tr>{th}</tr>{trs}</table>"
