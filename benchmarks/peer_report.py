"""The report of benchmarks/peers.py: the results and ratio tables, the chart, peers.md and
peers.json."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from peer_launch import PeerResult
    from peers import Level


def _num(v) -> float:
    return math.nan if v is None else float(v)


def fmt(v, digits: int = 0, approx: bool = False) -> str:
    v = _num(v)
    if math.isnan(v):
        return "–"
    return ("≈" if approx else "") + f"{v:,.{digits}f}"


def _ratio(a, b, digits: int = 2) -> str:
    a, b = _num(a), _num(b)
    return "–" if math.isnan(a) or math.isnan(b) or b == 0 else f"{a / b:.{digits}f}"


def rows_by_level(res: PeerResult) -> dict[int, dict]:
    return {row["concurrency"]: row for row in res.levels}


def results_table(results: list[PeerResult]) -> list[str]:
    lines = ["| peer | concurrency | completed | output tok/s | TTFT p50 (ms) | TTFT p99 (ms) | ITL p50 / p99 (ms) "
             "| TPOT mean (ms) |", "|---|---|---|---|---|---|---|---|"]
    for res in results:
        for row in res.levels:
            s, d = row["summary"], bool(row.get("derived"))
            if d:
                itl = f"≈{fmt(s['mean_itl_ms'])} (mean)"
                done = "batch 1"
            else:
                itl = f"{fmt(s['median_itl_ms'])} / {fmt(s['p99_itl_ms'])}"
                done = f"{s['completed']}/{row['num_requests']}"
            lines.append(f"| {res.peer} | {row['concurrency']} | {done} | {fmt(s['output_throughput'], 2, d)} | "
                         f"{fmt(s['median_ttft_ms'], 0, d)} | {fmt(s['p99_ttft_ms'])} | {itl} | "
                         f"{fmt(s.get('mean_tpot_ms'))} |")
    return lines


def ratios_table(results: list[PeerResult], concurrency: list[int]) -> list[str]:
    """tandem / peer per level: throughput (> 1: tandem faster), TTFT p99 and ITL p99 (< 1: tandem lower)."""
    tandem = next((r for r in results if r.peer == "tandem" and r.status == "ok"), None)
    if tandem is None:
        return ["tandem was not measured in this run, so there are no ratios."]
    mine = rows_by_level(tandem)
    lines = ["| concurrency | peer | output tok/s, tandem / peer | TTFT p99, tandem / peer | ITL p99, tandem / peer |",
             "|---|---|---|---|---|"]
    for c in concurrency:
        for res in results:
            theirs = rows_by_level(res).get(c)
            if res is tandem or res.status != "ok" or theirs is None or c not in mine:
                continue
            a, b = mine[c]["summary"], theirs["summary"]
            if theirs.get("derived"):
                itl = f"{_ratio(a['mean_itl_ms'], b['mean_itl_ms'])} (means)"
                ttft = f"{_ratio(a['median_ttft_ms'], b['median_ttft_ms'])} (p50 vs prefill time)"
            else:
                itl, ttft = _ratio(a["p99_itl_ms"], b["p99_itl_ms"]), _ratio(a["p99_ttft_ms"], b["p99_ttft_ms"])
            lines.append(f"| {c} | {res.peer} | {_ratio(a['output_throughput'], b['output_throughput'])} | "
                         f"{ttft} | {itl} |")
    return lines


def plot(results: list[PeerResult], concurrency: list[int], path: Path) -> None:
    from tandem.bench.report import save_figure  # selects the Agg backend first

    import matplotlib.pyplot as plt  # noqa: I001

    measured = [r for r in results if r.status == "ok"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / max(len(measured), 1)
    panels = (("output_throughput", "output tokens/s (higher is better)"),
              ("p99_itl_ms", "ITL p99, ms (lower is better)"))
    for ax, (key, title) in zip(axes, panels):
        for k, res in enumerate(measured):
            levels = rows_by_level(res)
            ys = [_num(levels[c]["summary"].get(key)) if c in levels else math.nan for c in concurrency]
            xs = [i + (k - (len(measured) - 1) / 2) * width for i in range(len(concurrency))]
            bars = ax.bar(xs, ys, width, label=res.peer)
            ax.bar_label(bars, fmt="%.1f", fontsize=7)
        ax.set_xticks(range(len(concurrency)), [f"concurrency {c}" for c in concurrency])
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3)
    if measured:
        axes[0].legend(fontsize=8)
    save_figure(fig, path)


def _clean(obj):
    """JSON without NaN: missing numbers become null."""
    if isinstance(obj, float) and math.isnan(obj):
        return None
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return obj


def setup_lines(args, machine: dict, results: list[PeerResult]) -> list[str]:
    lines = [f"- CPU: {machine['cpu']}, {machine['cores']} cores; every peer on {args.threads} threads; "
             f"torch {machine['torch']} ({machine['torch_cpu_capability']}), Python {machine['python']}",
             f"- model: `{Path(args.model).name}`; tandem runs what its defaults resolve to on this machine "
             "(its /config below); transformers float32 (dequantized from the GGUF); llama.cpp runs the GGUF's "
             "own quantized weights"]
    for res in results:
        if res.status != "ok":
            continue
        extra = ""
        if res.peer == "tandem":
            engine = (res.info.get("/config") or {}).get("engine") or {}
            keys = ("policy", "max_num_seqs", "max_num_batched_tokens", "dtype", "quantization")
            extra = ", ".join(f"{k} {engine[k]}" for k in keys if k in engine)
        elif res.peer.startswith("llama"):
            extra = res.info.get("version", "")
        elif res.peer.startswith("transformers"):
            extra = f"transformers {res.info.get('transformers')}, attention {res.info.get('attn_implementation')}"
        lines.append(f"- {res.peer}: `{res.command}`" + (f" ({extra})" if extra else ""))
    return lines


def notes_lines(args, results: list[PeerResult]) -> list[str]:
    lines = []
    for res in results:
        if res.status != "ok":
            lines.append(f"- **{res.peer} not measured** ({res.status}): {res.reason.splitlines()[0]}")
        for row in res.levels:
            for note in row.get("notes") or []:
                lines.append(f"- {res.peer} c={row['concurrency']}: {note}")
            s = row.get("summary") or {}
            if "median_itl_target_ms" in s:
                counts = ", ".join(f"{s[k]:.0f} {k[len('steps_sized_'):]}" for k in s if k.startswith("steps_sized_"))
                ends = ", ".join(f"{s[k]:.0f} {k[len('pause_ends_'):]}" for k in s if k.startswith("pause_ends_") and s[k])
                lines.append(f"- {res.peer} c={row['concurrency']}: ITL target T {s['median_itl_target_ms']:.0f} ms "
                             f"(median); steps by what set their prompt work, as /metrics counted them: {counts}"
                             + (f"; burst pauses ended by {ends}" if ends else ""))
        prompts = [f"c={row['concurrency']}: {row['mean_prompt_tokens']:.1f}" for row in res.levels
                   if row.get("mean_prompt_tokens") is not None]
        if prompts:
            lines.append(f"- {res.peer} mean prompt tokens as counted by the peer: {', '.join(prompts)}")
    loads = [f"{r.peer} {r.info['load_avg_1m_before']:.2f}" for r in results if "load_avg_1m_before" in r.info]
    lines.append(f"- load average (1 min) of the machine just before each peer, {os.cpu_count()} cores: "
                 f"{', '.join(loads)}; anything else running on the cores distorts every figure, llama.cpp's "
                 "spinning threads most.")
    if any(r.peer == "llama-bench" and r.status == "ok" for r in results):
        lines.append(f"- llama-bench is not a server run: its row is derived from pp{args.input_len} and "
                     f"tg{args.output_len} at batch 1 (tg from an empty context): TTFT ≈ prompt / pp rate, ITL ≈ "
                     "1 / tg rate, output tok/s ≈ output / (prompt time + output time); no percentiles, no HTTP.")
    if any(r.peer == "transformers-static" and r.status == "ok" for r in results):
        lines.append("- transformers-static: a request counts as sent when its closed-loop slot frees, i.e. when "
                     "the previous batch has finished; all tokens of a batch share each step's timestamp.")
    if any(r.peer == "transformers-cb" and r.status == "ok" for r in results):
        lines.append("- transformers-cb: times are the manager's own records (request creation in add_request, "
                     "a timestamp per generated token, end of lifespan), not a network stream.")
    return lines


def write_report(out_dir: Path, command: str, args, machine: dict, levels: list[Level],
                 results: list[PeerResult]) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "peers.md", out_dir / "peers.json", out_dir / "peers.png"]
    plot(results, args.concurrency, paths[2])
    workload = {"input_len": args.input_len, "output_len": args.output_len, "concurrency": args.concurrency,
                "requests": {lv.concurrency: len(lv.requests) for lv in levels}, "greedy": True, "ignore_eos": True,
                "dataset": "random (tandem.bench, cut from real text)", "seed": args.seed}
    blob = {"command": command, "machine": machine, "workload": workload,
            "peers": [vars(r) for r in results]}
    paths[1].write_text(json.dumps(_clean(blob), indent=1, default=str) + "\n")
    requests = ", ".join(f"{len(lv.requests)} requests at concurrency {lv.concurrency}" for lv in levels)
    md = [
        "# tandem against peers", "",
        f"Regenerate: `.venv/bin/python {command}` (raw numbers: [peers.json](peers.json)); "
        f"run on {machine['date']}.", "",
        f"Workload: prompts of {args.input_len} tokens cut from real text (tandem.bench's `random` dataset), "
        f"{args.output_len} output tokens, greedy, EOS ignored; closed loop (all requests available at once, at "
        f"most C in flight); {requests}. Peers ran one after another, each warmed up first.", "",
        "## Set-up", "", *setup_lines(args, machine, results), "",
        "## Results", "", *results_table(results), "",
        "ITL: gaps between consecutive streamed tokens; TPOT: (E2E − TTFT) / (tokens − 1); output tok/s: output "
        "tokens of the level / its wall-clock duration. Definitions: tandem.latency.", "",
        "![output tok/s and ITL p99 per peer and concurrency](peers.png)", "",
        "## tandem relative to each peer", "", *ratios_table(results, args.concurrency), "",
        "Throughput ratio above 1: tandem delivers more output tokens per second; latency ratios below 1: "
        "tandem's latency is lower.", "",
    ]
    notes = notes_lines(args, results)
    if notes:
        md += ["## Notes", "", *notes, ""]
    paths[0].write_text("\n".join(md))
    return paths

