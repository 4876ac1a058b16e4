"""How well the simulator predicts this machine: calibrate a measured profile, then run every
built-in scenario with compare's default configurations for real and in the simulator, and
compare output throughput, TTFT p50/p99 and ITL p50/p99. Target: median |error| <= 10%.

The profile is calibrated again before each scenario (``--calibrate each``, the default), so a
machine whose speed drifts over the hour is measured minutes before the runs it predicts; the
report lists a few designed steps of every calibration, which shows how far the machine itself
moved. With ``--repeats N`` every real configuration runs N times round by round and the measured
figures are medians (the simulator is deterministic: one run).

    .venv/bin/python benchmarks/sim_accuracy.py --out docs/results/sim-accuracy
    .venv/bin/python benchmarks/sim_accuracy.py --out docs/results/sim-accuracy --profile my-profile.json \\
        --scenarios equal,long-prompts

Then TNG's equal-size case on the calibrated profile (the CPU contrast to the H100 roofline run):

    .venv/bin/python benchmarks/sim_tng.py --profile docs/results/sim-accuracy/profile-equal.json \\
        --concurrency 1,2,4,8,16,32 --out docs/results/sim-tng-cpu

Each scenario's real run takes what `tandem compare` takes (minutes per configuration on a 2-core
CPU); run it on a quiet machine. Engine flags (--model, --dtype, --quantization, ...) pass
through to both the calibration and the real runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from tandem.bench.calibrate import run_calibrate
from tandem.bench.compare import run_compare
from tandem.bench.config import CalibrateConfig
from tandem.bench.evaluate import InProcessEvaluator
from tandem.bench.scenarios import SCENARIOS
from tandem.bench.simulate import SimEvaluator
from tandem.cli_args import add_engine_args, engine_config_from_args
from tandem.sim.profile import describe, load_profile

METRICS = (("output_throughput", "output tok/s"), ("median_ttft_ms", "TTFT p50"), ("p99_ttft_ms", "TTFT p99"),
           ("median_itl_ms", "ITL p50"), ("p99_itl_ms", "ITL p99"))


def _by_load(result: dict, scenario: str) -> dict[str, list]:
    if result.get("loads"):
        return {load: r["evaluations"] for load, r in result["loads"].items()}
    return {scenario: result["evaluations"]}


REFERENCE = {"prefill 256": [[0, 256, 1]], "decode x16 at 128": [[128, 1, 16]], "decode x1 at 1024": [[1024, 1, 1]]}
"""Designed steps whose calibrated times show how the machine's speed moved between calibrations."""


def reference_steps(scenario: str, profile: dict) -> dict:
    timed = {json.dumps(t["spans"]): t["seconds"] for t in profile["fit"]["timed"]}
    return {"before": scenario, "date": profile["date"],
            **{k: 1000 * timed[json.dumps(v)] for k, v in REFERENCE.items() if json.dumps(v) in timed}}


def compare_rows(scenario: str, real: dict, sim: dict) -> list[dict]:
    """One row per (load, configuration): each metric measured, simulated and the relative error."""
    from tandem.bench.results import row

    rows = []
    sims = _by_load(sim, scenario)
    for load, evaluations in _by_load(real, scenario).items():
        simulated = {e.candidate.name: e for e in sims[load]}
        for ev in evaluations:
            r, s = row(ev), row(simulated[ev.candidate.name])
            out = {"scenario": scenario, "load": load, "config": ev.candidate.name}
            for metric, _ in METRICS:
                m, p = r[metric], s[metric]
                out[metric] = {"measured": m, "simulated": p, "error": (p - m) / m if m else None}
            rows.append(out)
    return rows


def markdown(rows: list[dict], meta: dict) -> str:
    errors = [(abs(r[m]["error"]), r, m) for r in rows for m, _ in METRICS if r[m]["error"] is not None]
    med = statistics.median(e for e, _, _ in errors) if errors else float("nan")
    worst = max(errors, key=lambda t: t[0]) if errors else None
    cal = meta.get("calibrations") or []
    profile = (f"one per scenario, each calibrated just before it ran (`profile-SCENARIO.json`); the last: "
               f"{meta['profile']}" if len(cal) > 1 else meta["profile"])
    md = ["# Simulator accuracy on this machine", "", f"Profile: {profile}.", "",
          f"    {meta['command']}", ""]
    if meta.get("repeats", 1) > 1:
        md += [f"Measured figures are medians of {meta['repeats']} runs of each configuration, round by round.", ""]
    md.append(f"**Median |error| over every metric and configuration: {100 * med:.1f}%** (target <= 10%).")
    if worst:
        e, r, m = worst
        md.append(f"Worst: {100 * e:.0f}% ({dict(METRICS)[m]}, {r['load']}, {r['config']}).")
    for m, name in METRICS:
        es = [abs(r[m]["error"]) for r in rows if r[m]["error"] is not None]
        if es:
            md.append(f"- {name}: median |error| {100 * statistics.median(es):.1f}%, worst {100 * max(es):.0f}%")
    if len(cal) > 1:
        md += ["", "Designed steps of those calibrations (ms): how much the machine's own speed moved during the run.",
               "",
               "| before | at | " + " | ".join(REFERENCE) + " |", "|---" * (len(REFERENCE) + 2) + "|"]
        for c in cal:
            md.append(f"| {c['before']} | {c['date']} | " + " | ".join(f"{c.get(k, float('nan')):,.1f}"
                                                                       for k in REFERENCE) + " |")
    head = " | ".join(f"{name} real / sim (err)" for _, name in METRICS)
    md += ["", f"| load | configuration | {head} |", "|---" * (len(METRICS) + 2) + "|"]
    for r in rows:
        cells = []
        for m, _ in METRICS:
            c = r[m]
            err = f"{100 * c['error']:+.0f}%" if c["error"] is not None else "n/a"
            cells.append(f"{c['measured']:,.1f} / {c['simulated']:,.1f} ({err})")
        md.append(f"| {r['load']} | {r['config']} | " + " | ".join(cells) + " |")
    return "\n".join(md) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--profile", help="a measured profile to use instead of calibrating")
    ap.add_argument("--calibrate", choices=("each", "once"), default="each",
                    help="calibrate before each scenario (default: a machine whose speed drifts is measured close "
                         "to the runs it predicts) or once at the start")
    ap.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated built-in scenarios")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-duration", type=float, default=1800.0)
    ap.add_argument("--repeats", type=int, default=1,
                    help="real runs of every configuration, round by round; the measured figures are their medians")
    add_engine_args(ap, skip=("seed",))
    args = ap.parse_args(argv)
    base = engine_config_from_args(args, seed=args.seed)
    out = Path(args.out)
    real_ev = InProcessEvaluator(base)
    rows, calibrations = [], []
    path = args.profile
    t0 = time.perf_counter()
    for name in args.scenarios.split(","):
        if not args.profile and (args.calibrate == "each" or not calibrations):
            path = str(out / (f"profile-{name}.json" if args.calibrate == "each" else "profile.json"))
            run_calibrate(CalibrateConfig(output=path), base, loaded=real_ev.loaded)
            calibrations.append(reference_steps(name, json.loads(Path(path).read_text())))
        profile = load_profile(path)
        sim_ev = SimEvaluator(profile, base.scheduler)
        real = run_compare(name, None, [], base, str(out / "real" / name), None, args.seed, args.max_duration, real_ev,
                           repeats=args.repeats)
        sim = run_compare(name, None, [], base, str(out / "sim" / name), None, args.seed, args.max_duration, sim_ev)
        rows += compare_rows(name, real, sim)
    meta = {"profile": describe(profile), "date": time.strftime("%Y-%m-%d %H:%M"), "repeats": args.repeats,
            "calibrations": calibrations,
            "command": "benchmarks/sim_accuracy.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "seconds": round(time.perf_counter() - t0)}
    (out / "accuracy.json").write_text(json.dumps({**meta, "rows": rows}, indent=1) + "\n")
    (out / "accuracy.md").write_text(markdown(rows, meta))
    print((out / "accuracy.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
