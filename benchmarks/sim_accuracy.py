"""How well the simulator predicts this machine: calibrate a measured profile, then run every
built-in scenario with compare's default configurations for real and in the simulator, and
compare output throughput, TTFT p50/p99 and ITL p50/p99. Target: median |error| <= 10%.

The profile is calibrated again before each scenario (``--calibrate each``, the default), so a
machine whose speed drifts over the hour is measured minutes before the runs it predicts; the
report lists a few designed steps of every calibration, which shows how far the machine itself
moved. With ``--repeats N`` every real configuration runs N times round by round and the measured
figures are medians (the simulator is deterministic: one run).

Even so the machine moves between a calibration and the runs after it. So a speed check
(``tandem.bench.speed_check``: three designed steps timed again, about two seconds) runs before
every real run and once after a scenario's last, against the same check run right after the
calibration; a run's ratios are the geometric means of the checks before and after it. The
simulator then runs twice: on the profile as calibrated, and with each real run simulated on the
profile rescaled by that run's ratios, the same medians taken (``sim-corrected/``).
The report gives both errors: the first is what a user with an old profile sees, the second how
well the simulator models the steps at the machine's speed of the moment.

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
import dataclasses
import json
import math
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
from tandem.bench.speed_check import PROBE, measure, recorded, rescaled, speed_check
from tandem.cli_args import add_engine_args, engine_config_from_args
from tandem.sim.design import fit_shapes
from tandem.sim.profile import Profile, describe, load_profile, profile_from_dict

METRICS = (("output_throughput", "output tok/s"), ("median_ttft_ms", "TTFT p50"), ("p99_ttft_ms", "TTFT p99"),
           ("median_itl_ms", "ITL p50"), ("p99_itl_ms", "ITL p99"))


def _by_load(result: dict, scenario: str) -> dict[str, list]:
    if result.get("loads"):
        return {load: r["evaluations"] for load, r in result["loads"].items()}
    return {scenario: result["evaluations"]}


def reference_steps(scenario: str, profile: dict) -> dict:
    """The speed check's steps at a calibration (its reference check): how the machine moved between calibrations."""
    return {"before": scenario, "date": profile["date"], **{k: 1000 * v for k, v in recorded(profile).items()}}


def _key(overrides: dict) -> str:
    return json.dumps(overrides, sort_keys=True, default=str)


RATIOS = ("ratio", "prefill_ratio", "decode_ratio")


class SpeedChecked:
    """The real evaluator, with a speed check before every run it starts; ``close`` checks once more
    after the last run. ``ratios`` gives each configuration's mean ratio to a profile."""

    def __init__(self, inner: InProcessEvaluator, block_size: int) -> None:
        self.inner = inner
        self.block_size = block_size
        self.checks: list[tuple[str | None, dict[str, float]]] = []

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def engine(self, overrides: dict):
        self.checks.append((_key(overrides), measure(self.inner.loaded, self.block_size)))
        return self.inner.engine(overrides)

    def close(self) -> None:
        self.checks.append((None, measure(self.inner.loaded, self.block_size)))

    def ratios(self, profile: dict) -> dict[str, list[dict[str, float]]]:
        """Per configuration, each run's ratios (overall, prompt step, decode steps): the geometric
        means of the checks just before and just after it."""
        out: dict[str, list[dict[str, float]]] = {}
        for (key, before), (_, after) in zip(self.checks, self.checks[1:]):
            if key is not None:
                a, b = speed_check(profile, before), speed_check(profile, after)
                out.setdefault(key, []).append({k: math.sqrt(a[k] * b[k]) for k in RATIOS})
        return out


class RescaledSim(SimEvaluator):
    """The simulator with each run of each configuration priced by its own rescaled profile (run i
    of a configuration by the i-th of its profiles, as compare runs them round by round)."""

    def __init__(self, profiles: dict[str, list[Profile]], base) -> None:
        super().__init__(next(iter(profiles.values()))[0], base)
        self.profiles = profiles
        self.runs: dict[str, int] = {}

    def profile_for(self, overrides: dict) -> Profile:
        key = _key(overrides)
        i = self.runs.get(key, 0)
        self.runs[key] = i + 1
        return self.profiles[key][i % len(self.profiles[key])]


def rescaled_profiles(profile: dict, ratios: dict[str, list[dict[str, float]]]) -> dict[str, list[Profile]]:
    """Per configuration, the profile rescaled by each of its runs' ratios."""
    return {key: [profile_from_dict(rescaled(profile, r), "rescaled profile") for r in runs]
            for key, runs in ratios.items()}


def plain_profile(calibrated: dict) -> dict:
    """``calibrated`` as the simulator priced steps before the knee: its forward pass refitted to
    the same timed steps without one."""
    d = dict(calibrated)
    timed = [([(s, n) for s, n, c in t["spans"] for _ in range(c)], t["seconds"]) for t in calibrated["fit"]["timed"]]
    d["forward"] = dataclasses.asdict(fit_shapes(timed, knees=(0.0,)))
    return d


def run_to_run(values: list[float]) -> float:
    """The median over the real runs of one configuration of each run's relative difference from
    the median of the others: how well one measurement predicts the next on this machine."""
    errs = []
    for i, v in enumerate(values):
        rest = statistics.median(values[:i] + values[i + 1:])
        if rest:
            errs.append(abs(v - rest) / rest)
    return statistics.median(errs)


def compare_rows(scenario: str, real: dict, sim: dict, corrected: dict | None = None,
                 ratios: dict[str, list[dict[str, float]]] | None = None, plain: dict | None = None) -> list[dict]:
    """One row per (load, configuration): each metric measured, simulated and the relative error;
    with ``corrected`` (the simulator on speed-checked profiles) that simulation and its error too,
    with ``plain`` (``plain_profile``'s) that one's."""
    from tandem.bench.results import row

    def err(p, m):
        return (p - m) / m if m else None

    rows = []
    sims = _by_load(sim, scenario)
    fixed = _by_load(corrected, scenario) if corrected else {}
    before = _by_load(plain, scenario) if plain else {}
    for load, evaluations in _by_load(real, scenario).items():
        simulated = {e.candidate.name: e for e in sims[load]}
        again = {e.candidate.name: e for e in fixed.get(load, [])}
        old = {e.candidate.name: e for e in before.get(load, [])}
        for ev in evaluations:
            r, s = row(ev), row(simulated[ev.candidate.name])
            c = row(again[ev.candidate.name]) if ev.candidate.name in again else None
            o = row(old[ev.candidate.name]) if ev.candidate.name in old else None
            out = {"scenario": scenario, "load": load, "config": ev.candidate.name}
            if ratios and _key(ev.candidate.overrides) in ratios:
                out["speed_ratios"] = ratios[_key(ev.candidate.overrides)]
            runs = getattr(ev, "runs", None) or []
            for metric, _ in METRICS:
                m, p = r[metric], s[metric]
                out[metric] = {"measured": m, "simulated": p, "error": err(p, m)}
                values = [x[metric] for x in runs if x.get(metric) is not None]
                if len(values) > 1:
                    out[metric].update(runs=values, run_to_run=run_to_run(values))
                if c is not None:
                    out[metric].update(corrected=c[metric], corrected_error=err(c[metric], m))
                if o is not None:
                    out[metric].update(plain=o[metric], plain_error=err(o[metric], m))
            rows.append(out)
    return rows


def _errors(rows: list[dict], key: str, metric: str | None = None) -> list[tuple[float, dict, str]]:
    return [(abs(r[m][key]), r, m) for r in rows for m, _ in METRICS
            if (metric is None or m == metric) and r[m].get(key) is not None]


def _summary(rows: list[dict], key: str, what: str, target: str = "(target <= 10%)") -> list[str]:
    errors = _errors(rows, key)
    if not errors:
        return []
    e, r, m = max(errors, key=lambda t: t[0])
    md = [f"**{what}: median |error| over every metric and configuration {100 * statistics.median(x for x, _, _ in errors):.1f}%**"
          f"{' ' + target if target else ''}; worst {100 * e:.0f}% ({dict(METRICS)[m]}, {r['load']}, {r['config']})."]
    for metric, name in METRICS:
        es = [x for x, _, _ in _errors(rows, key, metric)]
        if es:
            md.append(f"- {name}: median |error| {100 * statistics.median(es):.1f}%, worst {100 * max(es):.0f}%")
    return md + [""]


def markdown(rows: list[dict], meta: dict) -> str:
    cal = meta.get("calibrations") or []
    profile = (f"one per scenario, each calibrated just before it ran (`profile-SCENARIO.json`); the last: "
               f"{meta['profile']}" if len(cal) > 1 else meta["profile"])
    md = ["# Simulator accuracy on this machine", "", f"Profile: {profile}.", "",
          f"    {meta['command']}", ""]
    if meta.get("repeats", 1) > 1:
        md += [f"Measured figures are medians of {meta['repeats']} runs of each configuration, round by round.", ""]
    md += _summary(rows, "error", "As calibrated")
    corrected = any(r[m].get("corrected_error") is not None for r in rows for m, _ in METRICS)
    if corrected:
        md += _summary(rows, "corrected_error", "Speed-corrected")
        md += ["*As calibrated*: the simulator on the profile calibrated before the scenario. *Speed-corrected*: each real "
               "run simulated on that profile rescaled by the speed checks before and after it (three designed steps "
               "timed again, against the same check right after the calibration; `tandem.bench.speed_check`), and the "
               "same medians taken. "
               "The first is what an older profile predicts; the second, how well the simulator models the steps at "
               "the machine's speed of the moment.", ""]
    floor = _errors(rows, "run_to_run")
    if floor:
        md += _summary(rows, "run_to_run", "Real run to real run", target="")
        md += ["*Real run to real run*: each real run of a configuration against the median of its other runs "
               "(`run_to_run`): how far apart two measurements of the same configuration land on this machine, "
               "the noise any prediction of one run is judged against.", ""]
    plain = any(r[m].get("plain_error") is not None for r in rows for m, _ in METRICS)
    if plain:
        md += _summary(rows, "plain_error", "Without the knee")
        md += ["*Without the knee*: the same real runs against the simulator with each profile's forward pass "
               "refitted to its timed steps without a knee (`StepCost.knee`; not speed-corrected): what the knee "
               "changes, measured on one set of real runs.", ""]
    runs = [x for r in rows for x in r.get("speed_ratios", [])]
    if runs:
        def span(k):
            v = [x[k] for x in runs]
            return f"{min(v):.2f}x to {max(v):.2f}x (median {statistics.median(v):.2f}x)"
        md += [f"Speed checks over {len(runs)} real runs: the machine ran at {span('ratio')} its calibrated step "
               f"times; the prompt step at {span('prefill_ratio')}, the decode steps at {span('decode_ratio')}.", ""]
    if len(cal) > 1:
        md += ["The speed check's steps at each calibration (ms; the calibration's own times of those steps for a "
               "profile without a reference check): how much the machine's own speed moved during the run.",
               "",
               "| before | at | " + " | ".join(PROBE) + " |", "|---" * (len(PROBE) + 2) + "|"]
        for c in cal:
            md.append(f"| {c['before']} | {c['date']} | " + " | ".join(f"{c.get(k, float('nan')):,.1f}"
                                                                       for k in PROBE) + " |")
        md.append("")
    what = "real / sim (err)" + (" / corrected (err)" if corrected else "") + (" / plain (err)" if plain else "")
    head = " | ".join(f"{name} {what}" for _, name in METRICS)
    md += [f"| load | configuration | {head} |", "|---" * (len(METRICS) + 2) + "|"]

    def pct(e):
        return f"{100 * e:+.0f}%" if e is not None else "n/a"

    for r in rows:
        cells = []
        for m, _ in METRICS:
            c = r[m]
            cell = f"{c['measured']:,.1f} / {c['simulated']:,.1f} ({pct(c['error'])})"
            if "corrected" in c:
                cell += f" / {c['corrected']:,.1f} ({pct(c['corrected_error'])})"
            if "plain" in c:
                cell += f" / {c['plain']:,.1f} ({pct(c['plain_error'])})"
            cells.append(cell)
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
        checked = SpeedChecked(real_ev, base.cache.block_size)
        real = run_compare(name, None, [], base, str(out / "real" / name), None, args.seed, args.max_duration, checked,
                           repeats=args.repeats)
        checked.close()
        sim = run_compare(name, None, [], base, str(out / "sim" / name), None, args.seed, args.max_duration, sim_ev)
        calibrated = json.loads(Path(path).read_text())
        ratios = checked.ratios(calibrated)
        corrected = run_compare(name, None, [], base, str(out / "sim-corrected" / name), None, args.seed,
                                args.max_duration, RescaledSim(rescaled_profiles(calibrated, ratios), base.scheduler),
                                repeats=args.repeats)
        plain = run_compare(name, None, [], base, str(out / "sim-plain" / name), None, args.seed, args.max_duration,
                            SimEvaluator(profile_from_dict(plain_profile(calibrated), "plain profile"), base.scheduler))
        rows += compare_rows(name, real, sim, corrected, ratios, plain)
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
