"""Steps that mix prompt chunks of unlike shapes, with prompt attention grouped by shape (the
engine's rule, ``tandem.ops.paged_attention.prompt_sets``) and with every prompt chunk in one
padded group (the rule before it), alternating in one run; each step also alone per chunk, so
the report says what the mixed step costs against the sum of its parts.

    .venv/bin/python benchmarks/mixed_steps.py --out docs/results/amd-epyc-zen5/mixed-steps.json

Each step runs on the model runner ``--repeats`` times after one untimed run, the median counts;
the two rules alternate ``--rounds`` times. Engine flags are tandem's defaults.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

from tandem.runner.step_timing import time_steps
from tandem.build import load_model, set_threads
from tandem.config import EngineConfig
from tandem.core.step import KVLayout
from tandem.kernels.cpu_features import cpu_model
from tandem.ops import paged_attention
from tandem.runner.runner import ModelRunner

# (start, tokens) per chunk: a question after a cached 1,024-token prefix beside a fresh prompt,
# two such questions beside one, chunks of a budget split between a finishing and a new prompt,
# and equal prompts (one group under both rules)
STEPS = (
    [(1024, 41), (0, 193)],
    [(1024, 33), (192, 97)],
    [(1024, 42), (1024, 30), (288, 97)],
    [(257, 1)] * 4 + [(250, 7), (0, 117)],
    [(0, 64)] * 4,
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    cfg = EngineConfig()
    set_threads(cfg.model.threads)
    loaded = load_model(cfg.model)
    layout = KVLayout(4096, 16)
    runner = ModelRunner(loaded.model, layout, loaded.device, loaded.dtype, cfg.model.seed)
    parts = sorted({(c,) for s in STEPS for c in s})
    times: dict[str, dict[tuple, list[float]]] = {"grouped": {}, "one group": {}}
    default = paged_attention.PAD_SLACK
    for _ in range(args.rounds):
        for rule, slack in (("grouped", default), ("one group", math.inf)):
            paged_attention.PAD_SLACK = slack
            for spans, sec in time_steps(runner, layout, [list(s) for s in STEPS], args.repeats):
                times[rule].setdefault(tuple(spans), []).append(sec)
    paged_attention.PAD_SLACK = default
    alone = {p[0]: sec for p, sec in zip(parts, (s for _, s in time_steps(runner, layout, [list(p) for p in parts],
                                                                      args.repeats)))}
    rows = []
    for spans in STEPS:
        key = tuple(spans)
        g, o = (statistics.median(times[r][key]) * 1000 for r in ("grouped", "one group"))
        parts_ms = sum(alone[c] for c in spans if c[1] > 1) * 1000
        rows.append({"chunks": [list(c) for c in spans], "grouped_ms": g, "one_group_ms": o,
                     "speedup": o / g, "prompt_chunks_alone_ms": parts_ms})
        print(f"{spans}: grouped {g:,.1f} ms, one group {o:,.1f} ms ({o / g:.2f}x); "
              f"its prompt chunks alone {parts_ms:,.1f} ms", flush=True)
    result = {"cpu": cpu_model(), "paths": loaded.paths(), "pad_slack": default, "repeats": args.repeats,
              "rounds": args.rounds, "rows": rows}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
