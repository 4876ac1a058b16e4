"""Reports of a run: result.json, a Markdown summary, PNG plots and one self-contained HTML page.

Plots: latency CDFs (TTFT, ITL, TPOT, E2E), throughput and queue length over time, and a
per-request token timeline in which every dot is a token, so stalls show as gaps.
"""

from __future__ import annotations

import base64
import html
import json
import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from tandem.bench.client import RequestResult  # noqa: E402
from tandem.bench.replay import RunData  # noqa: E402
from tandem.core.burst_pause import END_REASONS  # noqa: E402
from tandem.core.step import SIZING_LIMITS  # noqa: E402
from tandem.ops.modes import describe_paths  # noqa: E402

PLOTS = ("latency_cdf.png", "throughput_queue.png", "token_timeline.png")


def save_figure(fig, path) -> None:
    """Every report PNG: tight layout, one resolution, the figure closed (no leaked memory)."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _cdf(ax, values: list[float], label: str) -> None:
    xs = sorted(v * 1000 for v in values)
    if not xs:
        return
    ys = [(i + 1) / len(xs) for i in range(len(xs))]
    ax.step(xs, ys, where="post", label=label)


def plot_latency_cdf(results: list[RequestResult], path: Path, itl_target_ms: float | None = None) -> None:
    """TTFT, ITL, TPOT and E2E CDFs; ``itl_target_ms``: the engine's median ITL target, marked on ITL's."""
    ok = [r for r in results if r.success]
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.6))
    series = [
        ("TTFT", [r.ttft for r in ok if r.ttft is not None]),
        ("ITL", [g for r in ok for g in r.itls]),
        ("TPOT", [r.tpot for r in ok if r.tpot is not None]),
        ("E2E latency", [r.e2e for r in ok if r.e2e is not None]),
    ]
    for ax, (name, values) in zip(axes, series):
        _cdf(ax, values, name)
        ax.set_title(f"{name} CDF")
        ax.set_xlabel("milliseconds")
        ax.set_ylabel("fraction of " + ("gaps" if name == "ITL" else "requests"))
        ax.grid(alpha=0.3)
        if values and max(values) / max(min(values), 1e-9) > 50:
            ax.set_xscale("log")
        if name == "ITL" and itl_target_ms:
            ax.axvline(itl_target_ms, color="tab:red", linestyle="--", linewidth=1,
                       label=f"ITL target {itl_target_ms:,.0f} ms (engine, median)")
            ax.legend(loc="lower right", fontsize=8)
    save_figure(fig, path)


def plot_throughput_queue(data: RunData, path: Path, bin_s: float | None = None) -> None:
    ok = [r for r in data.results if r.success]
    end = max([data.duration] + [t for r in ok for t in r.token_times[-1:]])
    bin_s = bin_s or max(0.25, end / 60)
    nbins = max(1, math.ceil(end / bin_s))
    counts = [0] * nbins
    for r in ok:
        for t in r.token_times:
            counts[min(nbins - 1, int(t / bin_s))] += 1
    xs = [(i + 0.5) * bin_s for i in range(nbins)]
    # in flight, from the client's view: sent and not yet finished
    events = sorted([(r.send_time, 1) for r in data.results if not math.isnan(r.send_time)] +
                    [(r.finish_time, -1) for r in data.results if r.finish_time is not None])
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(12, 6), sharex=True)
    ax1.plot(xs, [c / bin_s for c in counts], color="tab:blue")
    ax1.set_ylabel("output tokens/s")
    ax1.set_title("Output throughput over time")
    ax1.grid(alpha=0.3)
    level, tx, ty = 0, [0.0], [0]
    for t, d in events:
        tx.append(t)
        ty.append(level)
        level += d
        tx.append(t)
        ty.append(level)
    ax2.plot(tx, ty, color="tab:gray", label="in flight (client)")
    if data.samples:
        st = [t for t, _ in data.samples]
        for key, color in (("running", "tab:green"), ("waiting", "tab:red")):
            if any(key in g for _, g in data.samples):
                ax2.plot(st, [g.get(key, math.nan) for _, g in data.samples], color=color, label=f"{key} (server)")
    ax2.set_ylabel("requests")
    ax2.set_xlabel("seconds since start")
    ax2.set_title("Queue")
    ax2.legend(loc="upper right")
    ax2.grid(alpha=0.3)
    save_figure(fig, path)


def plot_token_timeline(results: list[RequestResult], path: Path, max_requests: int = 80) -> None:
    ok = [r for r in results if r.success][:max_requests]
    fig, ax = plt.subplots(figsize=(12, max(3.0, 0.12 * len(ok) + 1.5)))
    for row, r in enumerate(ok):
        ax.plot([r.send_time, r.token_times[0]], [row, row], color="tab:orange", linewidth=1)
        ax.scatter(r.token_times, [row] * len(r.token_times), s=2, color="tab:blue")
        worst = r.stall
        if worst is not None and len(r.token_times) > 1:
            i = max(range(1, len(r.token_times)), key=lambda k: r.token_times[k] - r.token_times[k - 1])
            ax.plot([r.token_times[i - 1], r.token_times[i]], [row, row], color="tab:red", linewidth=2)
    ax.set_xlabel("seconds since start")
    ax.set_ylabel("request")
    ax.set_title("Token timeline: orange = waiting for the first token, dots = tokens, red = longest stall")
    ax.grid(alpha=0.2)
    save_figure(fig, path)


def _fmt(v) -> str:
    if isinstance(v, float):
        return "n/a" if math.isnan(v) else f"{v:,.2f}"
    return str(v)


def markdown(summary: dict, classes: dict[str, dict], meta: dict) -> str:
    lines = [f"# Benchmark: {meta.get('label', 'run')}", ""]
    lines += [f"- target: `{meta.get('target')}`", f"- workload: {meta.get('workload_line')}"]
    paths = meta.get("paths")
    if paths:
        lines.append(f"- engine paths: {describe_paths(paths, reason=False)}")
    if meta.get("load_generator_cpu"):
        lines.append(f"- load generator CPU: {meta['load_generator_cpu']}")
    lines.append("")
    lines += ["| metric | value |", "|---|---|"]
    order = ["completed", "failed", "duration", "request_throughput", "output_throughput", "total_token_throughput",
             "request_goodput", "recomputed_tokens", "cached_prompt_tokens", "cached_prompt_fraction",
             "prefix_cache_hit_rate", *(f"steps_sized_{limit}" for limit in SIZING_LIMITS),
             *(f"pause_ends_{reason}" for reason in END_REASONS)]
    units = {"duration": " s", "request_throughput": " req/s", "output_throughput": " tok/s",
             "total_token_throughput": " tok/s", "request_goodput": " req/s", "recomputed_tokens": " tokens",
             "cached_prompt_tokens": " tokens", **{f"steps_sized_{limit}": " steps" for limit in SIZING_LIMITS},
             **{f"pause_ends_{reason}": " pauses" for reason in END_REASONS}}
    for k in order:
        if k in summary:
            lines.append(f"| {k} | {_fmt(summary[k])}{units.get(k, '')} |")
    for k, v in summary.items():
        if k.endswith("_ms"):
            lines.append(f"| {k} | {_fmt(v)} ms |")
    if summary.get("errors"):
        lines += ["", "Errors:", ""] + [f"- {k}: {v}" for k, v in summary["errors"].items()]
    if len(classes) > 1:
        lines += group_table("Per class", "class", classes)
    if meta.get("per_user"):
        lines += group_table("Per user", "user", meta["per_user"])
    for note in meta.get("notes", []):
        lines += ["", f"> {note}"]
    return "\n".join(lines) + "\n"


def group_table(title: str, label: str, groups: dict[str, dict]) -> list[str]:
    lines = ["", f"## {title}", "", f"| {label} | completed | output tok/s | TTFT p50 / p99 ms | ITL p50 / p99 ms |",
             "|---|---|---|---|---|"]
    for name, s in groups.items():
        lines.append(f"| {name} | {s['completed']} | {_fmt(s['output_throughput'])} | "
                     f"{_fmt(s.get('median_ttft_ms', math.nan))} / {_fmt(s.get('p99_ttft_ms', math.nan))} | "
                     f"{_fmt(s.get('median_itl_ms', math.nan))} / {_fmt(s.get('p99_itl_ms', math.nan))} |")
    return lines


def write_report(result_dir: Path, data: RunData, summary: dict, classes: dict, meta: dict) -> list[Path]:
    result_dir.mkdir(parents=True, exist_ok=True)
    result = {**summary, "per_class": classes, **{k: v for k, v in meta.items() if k != "label"}}
    (result_dir / "result.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    (result_dir / "requests.jsonl").write_text("\n".join(json.dumps(r.to_dict()) for r in data.results) + "\n")
    md = markdown(summary, classes, meta)
    (result_dir / "summary.md").write_text(md)
    plot_latency_cdf(data.results, result_dir / PLOTS[0], summary.get("median_itl_target_ms"))
    plot_throughput_queue(data, result_dir / PLOTS[1])
    plot_token_timeline(data.results, result_dir / PLOTS[2])
    images = "".join(
        f'<h2>{html.escape(name[:-4].replace("_", " "))}</h2>'
        f'<img src="data:image/png;base64,{base64.b64encode((result_dir / name).read_bytes()).decode()}" '
        f'style="max-width:100%">'
        for name in PLOTS
    )
    page = (
        "<!doctype html><html><head><meta charset='utf-8'><title>tandem bench</title>"
        "<style>body{font-family:sans-serif;max-width:1200px;margin:auto;padding:1em}"
        "pre{background:#f5f5f5;padding:1em;overflow:auto}</style></head><body>"
        f"<pre>{html.escape(md)}</pre>{images}</body></html>"
    )
    (result_dir / "report.html").write_text(page)
    return [result_dir / n for n in ("result.json", "summary.md", "report.html", *PLOTS)]
