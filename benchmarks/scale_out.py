"""1 against 2 replicas, and the three routing policies, on the shared-prefix load; and what the
Ray path costs against the plain server.

Each configuration is a `tandem serve` started here (its own process group), loaded with `tandem
bench --scenario shared-prefix`, its ingress's /metrics read at the end (requests per replica, the
router's prefix-hit share), then stopped with SIGINT. A single-stream probe (sequential requests,
fixed lengths) before the load gives TTFT and ITL with nothing else running, which is where the
Ray path's own cost shows: the plain server against the same single replica served through Ray
Serve (`--ray-address local`).

On a 2-core machine two replicas of one thread each have no more compute than one of two threads:
what this shows is correctness and the routing effect, not scaling.

    .venv/bin/python benchmarks/scale_out.py --out docs/results/scale-out
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
TANDEM = [sys.executable, "-m", "tandem.cli"]
CONFIGS = [
    ("plain, 1 process", []),
    ("Ray, 1 replica", ["--ray-address", "local"]),
    ("Ray, 2 x round-robin", ["--replicas", "2", "--routing", "round-robin"]),
    ("Ray, 2 x least-loaded", ["--replicas", "2", "--routing", "least-loaded"]),
    ("Ray, 2 x prefix-aware", ["--replicas", "2", "--routing", "prefix-aware"]),
]
KEYS = ("completed", "failed", "output_throughput", "p50_ttft_ms", "p99_ttft_ms", "p50_itl_ms", "p99_itl_ms",
        "cached_prompt_fraction", "prefix_cache_hit_rate", "duration")


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(args: list[str], port: int, log: Path) -> subprocess.Popen:
    out = log.open("w")
    proc = subprocess.Popen([*TANDEM, "serve", "--port", str(port), *args], stdout=out, stderr=subprocess.STDOUT,
                            start_new_session=True, cwd=ROOT)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError("server did not start within 600 s")


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def bench(port: int, out: Path, extra: list[str]) -> dict:
    subprocess.run([*TANDEM, "bench", "--base-url", f"http://127.0.0.1:{port}", "--ignore-eos",
                    "--result-dir", str(out), *extra], check=True, cwd=ROOT,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    summary = json.loads((out / "result.json").read_text())
    for bulky in ("report.html", "requests.jsonl", "token_timeline.png"):  # the summary and plots stay
        (out / bulky).unlink(missing_ok=True)
    return {k: summary.get(k) for k in KEYS}


def router_view(port: int) -> dict:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
    per_replica: dict[str, float] = {}
    reasons: dict[str, float] = {}
    for labels, value in re.findall(r'^tandem:router_requests_total\{([^}]*)\} (\S+)', text, re.M):
        d = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        per_replica[d["replica"]] = per_replica.get(d["replica"], 0) + float(value)
        reasons[d["reason"]] = reasons.get(d["reason"], 0) + float(value)
    matched = sum(float(v) for v in re.findall(r'^tandem:router_prefix_blocks_matched_total\{[^}]*\} (\S+)', text, re.M))
    requested = sum(float(v) for v in re.findall(r'^tandem:router_prefix_blocks_requested_total\{[^}]*\} (\S+)',
                                                   text, re.M))
    return {"requests_per_replica": sorted(per_replica.values(), reverse=True), "reasons": reasons,
            "router_prefix_hit_share": matched / requested if requested else None}


def cpu_model() -> str:
    from tandem.kernels.cpu_features import cpu_info
    return cpu_info().model


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="scale-out-results")
    ap.add_argument("--probe-requests", type=int, default=8)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for i, (name, flags) in enumerate(CONFIGS, 1):
        slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
        port = free_port()
        print(f"[{i}/{len(CONFIGS)}] {name}: starting `tandem serve {' '.join(flags)}`", file=sys.stderr, flush=True)
        proc = start(flags, port, out / f"{slug}.log")
        try:
            probe = bench(port, out / slug / "probe", ["--dataset-name", "random", "--random-input-len", "128",
                                                       "--random-output-len", "64", "--num-prompts",
                                                       str(args.probe_requests), "--max-concurrency", "1"])
            load = bench(port, out / slug / "shared-prefix", ["--scenario", "shared-prefix"])
            view = router_view(port) if flags else {}
        finally:
            stop(proc)
        row = {"name": name, "flags": flags, "probe": probe, "load": load, **view}
        rows.append(row)
        print(f"    probe TTFT p50 {probe['p50_ttft_ms']:.1f} ms, ITL p50 {probe['p50_itl_ms']:.2f} ms; "
              f"load {load['output_throughput']:.1f} tok/s, TTFT p50/p99 {load['p50_ttft_ms']:.0f}/"
              f"{load['p99_ttft_ms']:.0f} ms, cached {load['cached_prompt_fraction'] or 0:.1%}", file=sys.stderr)
    result = {"cpu": cpu_model(), "date": time.strftime("%Y-%m-%d %H:%M"), "rows": rows,
              "command": "benchmarks/scale_out.py --out " + args.out}
    (out / "scale_out.json").write_text(json.dumps(result, indent=1))
    write_markdown(out, result)
    plot(out, rows)
    return 0


def write_markdown(out: Path, result: dict) -> None:
    lines = [f"# Replicas and routing on shared-prefix ({result['cpu']}, {result['date']})", "",
             f"`.venv/bin/python {result['command']}`", "",
             "Single stream (128-token prompts, 64 output tokens, one at a time):", "",
             "| configuration | TTFT p50 | ITL p50 |", "|---|---|---|"]
    for r in result["rows"]:
        p = r["probe"]
        lines.append(f"| {r['name']} | {p['p50_ttft_ms']:.1f} ms | {p['p50_itl_ms']:.2f} ms |")
    lines += ["", "shared-prefix (`tandem bench --scenario shared-prefix --ignore-eos`):", "",
              "| configuration | output tok/s | TTFT p50 | TTFT p99 | ITL p99 | prompt tokens cached | "
              "router prefix-hit share | requests per replica |", "|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        x = r["load"]
        share = r.get("router_prefix_hit_share")
        lines.append(f"| {r['name']} | {x['output_throughput']:.1f} | {x['p50_ttft_ms']:.0f} ms | "
                     f"{x['p99_ttft_ms']:.0f} ms | {x['p99_itl_ms']:.0f} ms | {x['cached_prompt_fraction'] or 0:.1%} | "
                     f"{'' if share is None else f'{share:.1%}'} | "
                     f"{' / '.join(f'{v:.0f}' for v in r.get('requests_per_replica', [])) or '-'} |")
    lines += ["", "Requests per replica and the router's share count the probe's requests too (8 random prompts "
              "with nothing to share). Two replicas have one thread each; the plain server and the single "
              "replica have two.", "", "![TTFT and cached share](scale_out.png)", ""]
    (out / "scale_out.md").write_text("\n".join(lines))


def plot(out: Path, rows: list[dict]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["name"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    x = range(len(rows))
    axes[0].bar([i - 0.2 for i in x], [r["load"]["p50_ttft_ms"] for r in rows], 0.4, label="p50")
    axes[0].bar([i + 0.2 for i in x], [r["load"]["p99_ttft_ms"] for r in rows], 0.4, label="p99")
    axes[0].set_ylabel("TTFT (ms)")
    axes[0].legend()
    axes[1].bar(x, [100 * (r["load"]["cached_prompt_fraction"] or 0) for r in rows])
    axes[1].set_ylabel("prompt tokens served from the prefix cache (%)")
    axes[2].bar(x, [r["load"]["output_throughput"] for r in rows])
    axes[2].set_ylabel("output throughput (tok/s)")
    for ax in axes:
        ax.set_xticks(list(x))
        ax.set_xticklabels(names, rotation=25, ha="right", fontsize=8)
    fig.suptitle("shared-prefix: 1 vs 2 replicas and the routing policies")
    fig.tight_layout()
    fig.savefig(out / "scale_out.png", dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
