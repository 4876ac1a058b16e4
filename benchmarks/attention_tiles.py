"""Prompt attention's query tile (``tandem.ops.paged_attention.QUERY_TILE``): prefill time of the
same prompts at several tile sizes, the sizes taking turns in one process so a machine whose speed
drifts affects each alike.

    .venv/bin/python benchmarks/attention_tiles.py --out docs/results/amd-epyc-zen5/attention-tiles.json

Each case (N prompts of L tokens, one step: the budget holds them all) is prefilled ``--rounds``
times per tile size with fresh prompt texts (no prefix cache), one untimed warm-up first; the
median counts. Engine flags are tandem's defaults otherwise.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from tandem import LLM, SamplingParams
from tandem.kernels.cpu_features import cpu_model
from tandem.ops import paged_attention


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    return [[2] + [100 + (seed * 31 + i * 7 + j) % 5000 for j in range(length - 1)] for i in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiles", default="256,128,64")
    ap.add_argument("--cases", default="2x256,1x1024", help="NxL: N prompts of L tokens in one step")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--out", default="docs/results/attention-tiles.json")
    args = ap.parse_args()
    tiles = [int(t) for t in args.tiles.split(",")]
    cases = [tuple(int(v) for v in c.split("x")) for c in args.cases.split(",")]
    budget = max(n * length for n, length in cases)
    llm = LLM(max_num_seqs=max(n for n, _ in cases), max_num_batched_tokens=budget, max_model_len=max(2048, budget),
              enable_prefix_caching=False)
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    default_tile = paged_attention.QUERY_TILE
    rows = []
    try:
        for n, length in cases:
            llm.generate(prompts(n, length, 999), params)  # warm-up
            times: dict[int, list[float]] = {t: [] for t in tiles}
            for r in range(args.rounds):
                for tile in tiles:
                    paged_attention.QUERY_TILE = tile
                    t0 = time.perf_counter()
                    llm.generate(prompts(n, length, r), params)
                    times[tile].append(time.perf_counter() - t0)
            row = {"prompts": n, "tokens": length,
                   "median_ms": {str(t): statistics.median(v) * 1e3 for t, v in times.items()}}
            rows.append(row)
            print(f"{n} x {length} tokens: " + ", ".join(f"tile {t}: {ms:.1f} ms" for t, ms in row["median_ms"].items()),
                  flush=True)
    finally:
        paged_attention.QUERY_TILE = default_tile
    result = {"command": "benchmarks/attention_tiles.py " + " ".join(sys.argv[1:]),
              "cpu": cpu_model(), "paths": llm.loaded.paths(), "rounds": args.rounds,
              "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "cases": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
