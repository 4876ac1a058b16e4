"""What a step pays once for carrying prompt work: sixteen decodes at context 256 alone, then with
one fresh prompt chunk of 2 to 256 tokens, and each chunk alone, on the engine's default mode.

    .venv/bin/python benchmarks/prompt_step_cost.py --out docs/results/intel-xeon-amx/2026-12-05/prompt-step-cost.json

The extra time a chunk adds to the decode step, fitted as a line in its tokens over the small
chunks (up to 64 tokens), has an intercept: the fixed cost of a prompt step (``per_prompt_step``
in the step-time model, ``tandem.core.step_time``), which a per-token cost alone would read as a
steep price for a step's first prompt tokens. Each step runs ``--repeats`` times after one untimed
run, the median counts; all steps are timed ``--rounds`` times, interleaved.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from tandem.build import load_model, set_threads
from tandem.config import EngineConfig
from tandem.core.step import KVLayout
from tandem.kernels.cpu_features import cpu_model
from tandem.runner.runner import ModelRunner
from tandem.runner.step_timing import time_steps
from tandem.sim.design import fit_shapes

DECODES = [(256, 1)] * 16
CHUNKS = (2, 16, 64, 128, 256)
SMALL = 64
"""Chunks up to this many tokens make the line whose intercept is the fixed cost."""


def line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares (intercept, slope) of y over x."""
    mx = statistics.fmean(x for x, _ in points)
    my = statistics.fmean(y for _, y in points)
    slope = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
    return my - slope * mx, slope


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    cfg = EngineConfig()
    set_threads(cfg.model.threads)
    loaded = load_model(cfg.model)
    layout = KVLayout(1024, 16)
    runner = ModelRunner(loaded.model, layout, loaded.device, loaded.dtype, cfg.model.seed)
    steps = [DECODES] + [DECODES + [(0, n)] for n in CHUNKS] + [[(0, n)] for n in CHUNKS]
    times: dict[tuple, list[float]] = {}
    for r in range(args.rounds):
        for spans, sec in time_steps(runner, layout, steps, args.repeats):
            times.setdefault(tuple(spans), []).append(sec)
        print(f"round {r + 1}/{args.rounds} done", flush=True)
    ms = {k: 1000 * statistics.median(v) for k, v in times.items()}
    decode_ms = ms[tuple(DECODES)]
    rows = []
    for n in CHUNKS:
        mixed, alone = ms[tuple(DECODES + [(0, n)])], ms[((0, n),)]
        rows.append({"prompt_tokens": n, "mixed_ms": mixed, "added_ms": mixed - decode_ms, "alone_ms": alone})
        print(f"16 decodes + {n:>3} prompt tokens: {mixed:8.1f} ms (+{mixed - decode_ms:7.1f} ms); "
              f"the chunk alone {alone:8.1f} ms", flush=True)
    intercept, slope = line([(r["prompt_tokens"], r["added_ms"]) for r in rows if r["prompt_tokens"] <= SMALL])
    fitted = fit_shapes([(list(k), v / 1000) for k, v in ms.items()])
    print(f"16 decodes alone {decode_ms:.1f} ms; a prompt chunk adds {intercept:.1f} ms + {slope:.2f} ms/token "
          f"(chunks up to {SMALL} tokens); the step-time model fitted to all these steps: "
          f"per_prompt_step {fitted.per_prompt_step * 1000:.1f} ms, per_token {fitted.per_token * 1000:.2f} ms",
          flush=True)
    result = {"cpu": cpu_model(), "paths": loaded.paths(), "repeats": args.repeats, "rounds": args.rounds,
              "decodes_ms": decode_ms, "rows": rows, "fixed_ms": intercept, "per_token_ms": slope,
              "fitted": fitted.__dict__}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
