"""The default ITL target's frontier at peers.py's load, simulated, with measured points beside it.

peers.py's C=16 level (256-token prompts, 128 output tokens, greedy, EOS ignored, a closed loop of
32 requests) runs in the simulator once per ``itl_target_factor``, on a measured cost profile of
this machine (`tandem calibrate`); every tandem and llama-server point of the peers.py result
directories given with ``--measured`` is drawn beside the simulated line (tandem's labelled by the
factor its /config reports). So one can read off, in seconds, which factor would put tandem's
TTFT p99 and ITL p99 both at or below a peer's point, and check the simulator against the runs.
``--policies`` adds a point per other scheduling policy (``prefill-first``, ``static``), each with
every other setting at its default, on every line: where another policy lands against the
chunked policy's line at the same load.

``--slowdowns`` adds lines for a host that runs slower than when tandem started: every step costs
that many times the profile's while the start-up estimate, which prices the default target T,
stays the profile's. A shared machine's speed moves by a fifth or more over minutes, and at a small
factor a prompt's share of a step is the little that T leaves beside the decodes, so this is where
measured runs leave the quiet-machine line.

    .venv/bin/tandem calibrate --output docs/results/amd-epyc-zen3/2026-12-07/profile.json
    .venv/bin/python benchmarks/sim_frontier.py --profile docs/results/amd-epyc-zen3/2026-12-07/profile.json \\
        --measured docs/results/amd-epyc-zen3/2026-12-07/peers-quiet docs/results/amd-epyc-zen3/2026-12-07/quiet-frontier/* \\
        --slowdowns 1,1.3 \\
        --out docs/results/amd-epyc-zen3/2026-12-07/sim-frontier

Writes ``sim_frontier.json``, ``sim_frontier.md`` and ``sim_frontier.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import textwrap
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from sim_tng import requests  # noqa: E402

from tandem.bench.replay import run_inprocess  # noqa: E402
from tandem.bench.simulate import SimEvaluator  # noqa: E402
from tandem.bench.summary import summarize_run  # noqa: E402
from tandem.bench.workload import ArrivalSpec  # noqa: E402
from tandem.config import POLICIES, SchedulerConfig  # noqa: E402
from tandem.core.step_time import StepCost  # noqa: E402
from tandem.sim.profile import describe, load_profile  # noqa: E402

OTHER_POLICIES = tuple(p for p in POLICIES if p != "chunked")
"""What ``--policies`` takes: the chunked policy is the factors' line."""
FIGURES = ("output_throughput", "p50_ttft_ms", "p99_ttft_ms", "p50_itl_ms", "p99_itl_ms")


def slower(profile, slowdown: float):
    """``profile`` with every step costing ``slowdown`` times as much, its start-up estimate unchanged."""
    def scale(cost):
        if cost is None or slowdown == 1.0:
            return cost
        if not isinstance(cost, StepCost):
            raise SystemExit("--slowdowns: needs a measured profile (its step cost a formula)")
        return StepCost(*(v * slowdown for v in cost.vector()), knee=cost.knee)
    return dataclasses.replace(profile, cost=scale(profile.cost), overhead=scale(profile.overhead))


def simulate(evaluator: SimEvaluator, factor: float | None, slowdown: float, args: argparse.Namespace,
             policy: str = "chunked") -> dict:
    """One simulated run: the chunked policy at ITL target factor ``factor``, or ``policy`` with
    its defaults (``factor`` None)."""
    reqs = requests(args.requests, args.input_len, args.output_len, evaluator.profile.vocab_size, args.seed)
    engine = evaluator.engine({"itl_target_factor": factor} if factor is not None else {"policy": policy})
    data = run_inprocess(engine, reqs, [0.0] * len(reqs), ArrivalSpec(max_concurrency=args.concurrency), True, 1e6)
    s = summarize_run(data.results, data.duration, [50, 99], ("ttft", "itl"))
    return {"policy": policy, "itl_target_factor": factor, "slowdown": slowdown, "completed": s["completed"],
            **{k: s[k] for k in FIGURES}}


def label(p: dict) -> str:
    """A simulated point's name: its factor on the chunked line, else its policy."""
    return f"{p['itl_target_factor']:g}" if p["itl_target_factor"] is not None else p["policy"]


def measured_points(dirs: list[str], concurrency: int) -> list[dict]:
    """Each peer's point at ``concurrency`` in each peers.py result directory (tandem's with the
    policy and the ITL target factor its /config reports; the factor None where the policy is not
    the chunked one, which alone reads it)."""
    points = []
    for d in dirs:
        path = Path(d) / "peers.json"
        if not path.is_file():
            raise SystemExit(f"--measured: {path} does not exist")
        run = json.loads(path.read_text())
        for peer in run["peers"]:
            if peer.get("status") != "ok":
                continue
            engine = peer.get("info", {}).get("/config", {}).get("engine", {})
            policy = engine.get("policy", "chunked")
            factor = engine.get("itl_target_factor") if policy == "chunked" else None
            for level in peer["levels"]:
                if level["concurrency"] != concurrency:
                    continue
                s = level["summary"]
                points.append({"peer": peer["peer"], "run": str(Path(d)), "policy": policy, "itl_target_factor": factor,
                               "date": run["machine"].get("date"), **{k: s[k] for k in FIGURES}})
    return points


def markdown(meta: dict, sim: list[dict], measured: list[dict]) -> str:
    head = "| output tok/s | TTFT p50 / p99 (ms) | ITL p50 / p99 (ms) |"

    def row(p: dict) -> str:
        return (f"{p['output_throughput']:.1f} | {p['p50_ttft_ms']:,.0f} / {p['p99_ttft_ms']:,.0f} | "
                f"{p['p50_itl_ms']:,.0f} / {p['p99_itl_ms']:,.0f} |")

    md = ["# The ITL target's frontier at peers.py's load, simulated, beside measured points", "",
          f"SIMULATED with the {meta['profile']}. {meta['requests']} requests of {meta['input_len']} prompt tokens "
          f"and {meta['output_len']} output tokens, closed loop at concurrency {meta['concurrency']}, "
          f"max_num_seqs {meta['max_num_seqs']}, every other setting tandem's default.", "",
          f"    {meta['command']}", "", "## Simulated", "",
          "| steps' cost / start-up estimate's | itl_target_factor (chunked) or policy " + head, "|---|---|---|---|---|"]
    md += [f"| {p['slowdown']:g} | {label(p)} | " + row(p) for p in sim]
    if measured:
        md += ["", "## Measured (peers.py)", "", "| peer | itl_target_factor (chunked) or policy | run " + head,
               "|---|---|---|---|---|---|"]
        md += [f"| {p['peer']} | {label(p) if p['peer'] == 'tandem' else ''} | {p['run']} | " + row(p) for p in measured]
    return "\n".join(md) + "\n"


def plot(sim: list[dict], measured: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 5))
    lines = sorted({p["slowdown"] for p in sim})
    for i, slowdown in enumerate(lines):
        pts = [p for p in sim if p["slowdown"] == slowdown and p["itl_target_factor"] is not None]
        others = [p for p in sim if p["slowdown"] == slowdown and p["itl_target_factor"] is None]
        color = ("tab:blue", "tab:purple", "tab:orange", "tab:brown")[i % 4]
        name = "tandem, simulated" + ("" if slowdown == 1.0 else f", steps {slowdown:g}x the start-up estimate")
        ax.plot([p["p99_ttft_ms"] / 1000 for p in pts], [p["p99_itl_ms"] for p in pts], "o-", color=color, label=name)
        ax.plot([p["p99_ttft_ms"] / 1000 for p in others], [p["p99_itl_ms"] for p in others], "D", color=color,
                fillstyle="none", label=None if not others else name + ", other policies")
        for p in pts + others:
            ax.annotate(label(p), (p["p99_ttft_ms"] / 1000, p["p99_itl_ms"]),
                        textcoords="offset points", xytext=(5, 4), fontsize=8, color=color)
    styles = {"tandem": ("s", "tab:green"), "llama-server": ("x", "tab:red")}
    seen = set()
    for p in measured:
        marker, color = styles.get(p["peer"], ("^", "tab:gray"))
        legend = f"{p['peer']}, measured" if p["peer"] not in seen else None
        seen.add(p["peer"])
        ax.plot(p["p99_ttft_ms"] / 1000, p["p99_itl_ms"], marker, color=color, markersize=8, label=legend)
        if p["peer"] == "tandem":
            ax.annotate(label(p), (p["p99_ttft_ms"] / 1000, p["p99_itl_ms"]),
                        textcoords="offset points", xytext=(5, -10), fontsize=8, color=color)
    ax.set_xlabel("TTFT p99 (s)")
    ax.set_ylabel("ITL p99 (ms)")
    ax.set_title("\n".join(textwrap.wrap(title, 90)), fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def numbers(name: str, text: str) -> list[float]:
    """Comma-separated positive numbers (SystemExit naming ``--name`` otherwise)."""
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        raise SystemExit(f"--{name}: comma-separated numbers, got {text!r}") from None
    if not values or any(not v > 0 for v in values):
        raise SystemExit(f"--{name}: each must be > 0, got {text!r}")
    return values


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", required=True, help="a measured cost profile (tandem calibrate) or a shipped one")
    ap.add_argument("--factors", default="1.5,2,2.5,3,3.5,4,5", help="itl_target_factor values to simulate")
    ap.add_argument("--slowdowns", default="1", help="steps' cost over the start-up estimate's, one line each")
    ap.add_argument("--policies", default="", help="other scheduling policies to simulate as points, comma-separated "
                    f"(of {', '.join(OTHER_POLICIES)})")
    ap.add_argument("--measured", nargs="*", default=[], help="peers.py result directories to draw beside")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--max-num-seqs", type=int, default=16, help="as peers.py serves tandem")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    factors, slowdowns = numbers("factors", args.factors), numbers("slowdowns", args.slowdowns)
    policies = [p for p in args.policies.split(",") if p]
    for p in policies:
        if p not in OTHER_POLICIES:
            raise SystemExit(f"--policies: each must be one of {', '.join(OTHER_POLICIES)}"
                             f" (the chunked policy is the factors' line), got {p!r}")
    for name in ("concurrency", "requests", "input_len", "output_len", "max_num_seqs"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')}: must be >= 1, got {getattr(args, name)}")
    measured = measured_points(args.measured, args.concurrency)
    try:
        profile = load_profile(args.profile)
    except ValueError as exc:
        raise SystemExit(f"--profile: {exc}") from None
    t0 = time.perf_counter()
    sim = []
    for slowdown in slowdowns:
        evaluator = SimEvaluator(slower(profile, slowdown), SchedulerConfig(max_num_seqs=args.max_num_seqs))
        runs = [(f, "chunked") for f in factors] + [(None, p) for p in policies]
        for f, policy in runs:
            sim.append(simulate(evaluator, f, slowdown, args, policy))
            p = sim[-1]
            print(f"steps {slowdown:g}x, {'factor ' if f is not None else ''}{label(p)}: TTFT p99 {p['p99_ttft_ms']:,.0f} ms, "
                  f"ITL p99 {p['p99_itl_ms']:,.0f} ms, {p['output_throughput']:.1f} tok/s", file=sys.stderr)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"profile": describe(profile), "concurrency": args.concurrency, "requests": args.requests,
            "input_len": args.input_len, "output_len": args.output_len, "max_num_seqs": args.max_num_seqs,
            "seed": args.seed, "simulated_in_s": round(time.perf_counter() - t0, 2),
            "command": "benchmarks/sim_frontier.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "date": time.strftime("%Y-%m-%d %H:%M")}
    (out / "sim_frontier.json").write_text(json.dumps({**meta, "simulated": sim, "measured": measured}, indent=1) + "\n")
    (out / "sim_frontier.md").write_text(markdown(meta, sim, measured))
    plot(sim, measured, out / "sim_frontier.png", f"C={args.concurrency}: {describe(profile)}")
    print(f"wrote {out}/sim_frontier.json, sim_frontier.md, sim_frontier.png", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
