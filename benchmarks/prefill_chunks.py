"""Time to prefill one prompt alone at several step budgets: whether a long prompt costs more per
token in one big step than in small chunks (it did while prefill attention computed every
(query, key) pair of a chunk; docs/performance.md, "Prefill attention in tiles").

    .venv/bin/python benchmarks/prefill_chunks.py --lengths 1536,2048 --budgets 2048,512,128 \\
        --out docs/results/amd-epyc-zen5/prefill-chunks.json

Each (length, budget) is timed ``--repeats`` times after one untimed run; the median is reported.
Engine flags are tandem's defaults (the fastest mode on this machine); the prefix cache is off so
a repeat computes the prompt again.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

from tandem import LLM, SamplingParams
from tandem.kernels.cpu_features import cpu_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="1536,2048")
    ap.add_argument("--budgets", default="2048,512,128")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    budgets = [int(x) for x in args.budgets.split(",")]
    rows = []
    for budget in budgets:
        llm = LLM(max_model_len=max(lengths) + 16, max_num_batched_tokens=budget, enable_prefix_caching=False)
        rng = random.Random(0)
        params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
        for n in lengths:
            ids = [2] + [rng.randrange(1000, 50000) for _ in range(n - 1)]
            llm.generate(ids, params)  # untimed: first-touch and caches
            times = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                llm.generate(ids, params)
                times.append(time.perf_counter() - start)
            ms = statistics.median(times) * 1000
            rows.append({"prompt_tokens": n, "budget": budget, "ms": ms, "tok_per_s": n / ms * 1000})
            print(f"{n} tokens, budget {budget}: {ms:,.0f} ms ({n / ms * 1000:,.0f} tok/s)", flush=True)
    result = {"cpu": cpu_model(), "paths": llm.loaded.paths(), "rows": rows}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    main()
