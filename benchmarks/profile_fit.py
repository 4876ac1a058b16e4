"""How well a calibrated profile's forward model prices the steps of real engine loads on this
machine, step kind by step kind, and how far that moves from one load to the next.

    .venv/bin/python benchmarks/profile_fit.py --out docs/results/amd-epyc-zen5/2026-12-03/profile-fit.json

Calibrates a profile (as ``tandem calibrate`` does), then runs closed-loop loads of the chunked
policy (40 requests of 32–600 random prompt tokens, 48 tokens out, at most 16 at a time) at each
``--budgets`` token budget, and divides every step's measured forward time by the profile's
prediction for it. Per load and step kind (``StepStats.kind``: decode-only, mixed, prefill-only): the steps, and the
median, p10 and p90 of that ratio. A model that fits the steps and a machine that holds its speed
give medians near 1 in every row; rows whose medians differ by kind point at the model, rows whose
medians move together from load to load at the machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import sys
import time
from pathlib import Path

from tandem.bench.calibrate import run_calibrate
from tandem.bench.config import CalibrateConfig
from tandem.build import engine_for, load_model, set_threads
from tandem.config import EngineConfig
from tandem.core.sampling_params import SamplingParams
from tandem.core.step_time import StepCost, features
from tandem.kernels.cpu_features import cpu_model


def load(config: EngineConfig, loaded, budget: int, seed: int):
    """The steps of one closed-loop chunked load at ``budget`` tokens a step."""
    cfg = dataclasses.replace(config, scheduler=dataclasses.replace(
        config.scheduler, policy="chunked", max_num_batched_tokens=budget, max_num_seqs=16))
    engine = engine_for(cfg, loaded)
    rng = random.Random(seed)
    pending = [[rng.randrange(1, loaded.spec.vocab_size) for _ in range(rng.randint(32, 600))] for _ in range(40)]
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    while pending or engine.has_unfinished_requests():
        while pending and engine.num_waiting + engine.num_running < 16:
            engine.add_request(pending.pop(), params)
        engine.step()
    return [s for s in engine.step_stats if s.chunks]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budgets", default="512,128,256")
    ap.add_argument("--profile-out", default="/tmp/profile-fit-profile.json", help="where the calibration is written")
    ap.add_argument("--out", default="docs/results/profile-fit.json")
    args = ap.parse_args()
    config = EngineConfig.from_kwargs(model=None)
    set_threads(config.model.threads)
    loaded = load_model(config.model)
    profile = run_calibrate(CalibrateConfig(output=args.profile_out), config, loaded)
    forward = StepCost(**profile["forward"])
    print(f"calibrated: the forward fit's median |error| on its designed steps "
          f"{100 * profile['fit']['median_abs_error']:.1f}%", flush=True)
    rows = []
    for i, budget in enumerate(int(b) for b in args.budgets.split(",")):
        ratios: dict[str, list[float]] = {}
        for s in load(config, loaded, budget, seed=i + 1):
            ratios.setdefault(s.kind, []).append(s.forward_seconds / forward.predict(features(s.spans())))
        for k, r in sorted(ratios.items()):
            r.sort()
            row = {"budget": budget, "kind": k, "steps": len(r), "median": statistics.median(r),
                   "p10": r[len(r) // 10], "p90": r[min(len(r) - 1, 9 * len(r) // 10)]}
            rows.append(row)
            print(f"budget {budget}, {k} steps ({row['steps']}): measured / predicted forward median "
                  f"{row['median']:.2f} (p10 {row['p10']:.2f}, p90 {row['p90']:.2f})", flush=True)
    result = {"command": "benchmarks/profile_fit.py " + " ".join(sys.argv[1:]), "cpu": cpu_model(),
              "paths": loaded.paths(), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
              "fit_median_abs_error": profile["fit"]["median_abs_error"], "forward": profile["forward"],
              "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
