"""The ITL target's noise margin at C=16, in process: the peers' C=16 load (32 prompts of 256
tokens, 128 tokens out, greedy, at most 16 at a time) under ``--target-itl-ms T``, with the margin
at each share in turn (a fresh ``NoiseMargin`` per run, one engine), round by round.

    .venv/bin/python benchmarks/itl_margin.py --out docs/results/amd-epyc-zen5/2026-12-03/itl-margin.json

Per run: output tok/s, the margin factor the policy sized steps with (min / median), the prompt
tokens of the steps that carried decodes and prompt work (median), the p99 of the decode gaps
(each step's cycle, start to the next step's start, counted once per decoding stream), and the
step-time model's error on each kind of step (cycle / prediction, median and p90). What it shows:
how far the margin shrinks the prompt share, and what the gaps would be without it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import tandem.core.policies as policies
from tandem import LLM, SamplingParams
from tandem.core.gap_ledgers import NoiseMargin
from tandem.kernels.cpu_features import cpu_model


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    return [[2] + [100 + (seed * 31 + i * 7 + j) % 5000 for j in range(length - 1)] for i in range(n)]


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def summarize(steps, factors: list[float], seconds: float, tokens: int) -> dict:
    gaps, ratios = [], {"decode": [], "mixed": [], "prefill": []}
    for s, nxt in zip(steps, steps[1:]):
        cycle = nxt.start - s.start
        gaps.extend([cycle] * s.num_decode_tokens)
        if s.predicted_seconds and s.kind in ratios:
            ratios[s.kind].append(cycle / s.predicted_seconds)
    mixed = [s.num_prefill_tokens for s in steps if s.kind == "mixed"]
    return {
        "output_tok_s": tokens / seconds, "seconds": seconds,
        "margin_min": min(factors, default=1.0), "margin_median": statistics.median(factors) if factors else 1.0,
        "mixed_steps": len(mixed), "mixed_prompt_tokens_median": statistics.median(mixed) if mixed else 0,
        "gap_p99_ms": _quantile(gaps, 0.99) * 1e3,
        "cycle_over_predicted": {k: {"steps": len(v), "median": statistics.median(v) if v else None,
                                     "p90": _quantile(v, 0.9) if v else None} for k, v in ratios.items()},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target-itl-ms", type=float, default=120.0)
    ap.add_argument("--shares", default="0.005,0", help="itl_margin_share values, taking turns")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default="docs/results/itl-margin.json")
    args = ap.parse_args()
    shares = [float(v) for v in args.shares.split(",")]
    factors: list[float] = []
    made = policies.PrefillShare.__init__

    def record(self, *a, **kw) -> None:  # the margin each step is sized with
        made(self, *a, **kw)
        if self.target is not None:
            factors.append(self.margin)

    policies.PrefillShare.__init__ = record
    try:
        runs, llm = run(args, shares, factors)
    finally:
        policies.PrefillShare.__init__ = made
    result = {"command": "benchmarks/itl_margin.py " + " ".join(sys.argv[1:]), "cpu": cpu_model(),
              "paths": llm.loaded.paths(), "target_itl_ms": args.target_itl_ms,
              "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "runs": runs}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


def run(args, shares: list[float], factors: list[float]) -> tuple[list[dict], LLM]:
    """The runs, round by round; ``factors`` collects the margin of each step sized in them."""
    llm = LLM(max_num_seqs=16, target_itl_ms=args.target_itl_ms, enable_prefix_caching=False)
    policy = llm.engine.scheduler.policy
    params = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)
    llm.generate(prompts(4, 256, 99), SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))  # warm-up
    runs = []
    for r in range(args.rounds):
        for share in shares:
            policy.margin = NoiseMargin(share)
            factors.clear()
            first = len(llm.engine.step_stats)
            t0 = time.perf_counter()
            llm.generate(prompts(32, 256, r), params)
            row = {"round": r, "itl_margin_share": share,
                   **summarize(list(llm.engine.step_stats)[first:], factors, time.perf_counter() - t0, 32 * 128)}
            runs.append(row)
            print(f"round {r}, margin share {share}: {row['output_tok_s']:.1f} tok/s, margin min "
                  f"{row['margin_min']:.2f} median {row['margin_median']:.2f}, prompt tokens per mixed step "
                  f"{row['mixed_prompt_tokens_median']:g}, gap p99 {row['gap_p99_ms']:.0f} ms", flush=True)
    return runs, llm


if __name__ == "__main__":
    main()
