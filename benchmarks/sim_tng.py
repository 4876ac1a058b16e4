"""TNG's chunked-prefill case in the simulator: equal-size requests (3000 or 1500 prompt tokens,
100 output tokens) at rising closed-loop concurrency, total token throughput for prefill-first
against chunked prefill at 512 / 2048 / 8192-token budgets.

    .venv/bin/python benchmarks/sim_tng.py --profile h100-sxm/llama-3.1-8b --out docs/results/sim-tng-h100
    .venv/bin/python benchmarks/sim_tng.py --profile docs/results/cpu-profile.json --input-lens 1500 \\
        --concurrency 1,2,4,8,16 --out docs/results/sim-tng-cpu

TNG measured up to +50% total throughput from chunked prefill in vLLM (Llama-3.1-8B, one H100).
The setting follows vLLM's defaults there: prefill-first gets an 8192-token budget per step (a
prompt longer than the budget runs alone), every configuration up to 256 sequences. Each prompt
is distinct random ids, so a prefix cache finds nothing to share.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

from tandem.bench.replay import run_inprocess
from tandem.bench.prompts import BenchRequest
from tandem.bench.simulate import SimEvaluator
from tandem.bench.summary import summarize_run
from tandem.bench.workload import ArrivalSpec
from tandem.config import SchedulerConfig
from tandem.sim.profile import describe, load_profile

CONFIGS = {
    "prefill-first": {"policy": "prefill-first", "max_num_batched_tokens": 8192},
    "chunked 512": {"policy": "chunked", "max_num_batched_tokens": 512},
    "chunked 2048": {"policy": "chunked", "max_num_batched_tokens": 2048},
    "chunked 8192": {"policy": "chunked", "max_num_batched_tokens": 8192},
}


def requests(n: int, input_len: int, output_len: int, vocab: int, seed: int) -> list[BenchRequest]:
    rng = random.Random(seed)
    return [BenchRequest(i, "equal", " ".join(f"t{rng.randrange(1, vocab)}" for _ in range(input_len)), input_len,
                         output_len) for i in range(n)]


def run_point(evaluator, overrides: dict, input_len: int, output_len: int, concurrency: int,
              waves: int, seed: int, vocab: int, min_requests: int = 16) -> dict:
    """``evaluator``: anything whose ``engine(overrides)`` gives an engine (a simulator, or the
    real engine over a loaded model); prompts are ``t<id>`` words the SimTokenizer reads as ids."""
    n = max(min_requests, waves * concurrency)
    reqs = requests(n, input_len, output_len, vocab, seed)
    engine = evaluator.engine(overrides)
    data = run_inprocess(engine, reqs, [0.0] * n, ArrivalSpec(max_concurrency=concurrency), True, 1e6)
    s = summarize_run(data.results, data.duration, [50, 99], ("ttft", "itl"))
    steps = engine.step_stats
    mixed = sum(1 for st in steps if st.num_prefill_tokens and st.num_decode_tokens)
    return {"requests": n, "completed": s["completed"], "total_token_throughput": s["total_token_throughput"],
            "output_throughput": s["output_throughput"], "p50_ttft_ms": s["p50_ttft_ms"],
            "p99_itl_ms": s["p99_itl_ms"], "steps": len(steps), "mixed_steps": mixed,
            "preemptions": engine.scheduler.num_preemptions}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default="h100-sxm/llama-3.1-8b")
    ap.add_argument("--input-lens", default="3000,1500")
    ap.add_argument("--output-len", type=int, default=100)
    ap.add_argument("--concurrency", default="1,2,4,8,16,32,64,128,256")
    ap.add_argument("--waves", type=int, default=4, help="requests per point: this many times the concurrency")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    profile = load_profile(args.profile)
    evaluator = SimEvaluator(profile, SchedulerConfig(max_num_seqs=args.max_num_seqs))
    lens = [int(v) for v in args.input_lens.split(",")]
    levels = [int(v) for v in args.concurrency.split(",")]
    t0 = time.perf_counter()
    results: dict = {}
    for input_len in lens:
        for name, overrides in CONFIGS.items():
            for c in levels:
                point = run_point(evaluator, overrides, input_len, args.output_len, c, args.waves, args.seed,
                                  profile.vocab_size)
                results.setdefault(str(input_len), {}).setdefault(name, {})[str(c)] = point
                print(f"{input_len} {name} c={c}: {point['total_token_throughput']:,.0f} tok/s", file=sys.stderr)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"profile": describe(profile), "output_len": args.output_len, "max_num_seqs": args.max_num_seqs,
            "configs": CONFIGS, "waves": args.waves, "seed": args.seed,
            "command": "benchmarks/sim_tng.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "simulated_in_s": round(time.perf_counter() - t0, 1), "date": time.strftime("%Y-%m-%d %H:%M")}
    (out / "sim_tng.json").write_text(json.dumps({**meta, "results": results}, indent=1) + "\n")
    plot(results, levels, out / "sim_tng.png", describe(profile))
    (out / "sim_tng.md").write_text(markdown(results, levels, meta))
    print(f"wrote {out}/sim_tng.json, sim_tng.md, sim_tng.png", file=sys.stderr)
    return 0


def markdown(results: dict, levels: list[int], meta: dict) -> str:
    md = ["# Chunked prefill vs prefill-first, simulated (TNG's equal-size case)", "",
          f"SIMULATED with the {meta['profile']}. {meta['output_len']} output tokens per request, closed loop, "
          f"{meta['waves']} x concurrency requests per point, max_num_seqs {meta['max_num_seqs']}; "
          f"prefill-first has an 8192-token budget.", "", f"    {meta['command']}", ""]
    for input_len, by_config in results.items():
        names = list(by_config)
        md += [f"## {input_len} prompt tokens: total token throughput (tok/s)", "",
               "| concurrency | " + " | ".join(names) + " | best chunked vs prefill-first |",
               "|---" * (len(names) + 2) + "|"]
        for c in map(str, levels):
            row = [by_config[n][c]["total_token_throughput"] for n in names]
            base = by_config["prefill-first"][c]["total_token_throughput"]
            best = max(by_config[n][c]["total_token_throughput"] for n in names if n != "prefill-first")
            md.append(f"| {c} | " + " | ".join(f"{v:,.0f}" for v in row) + f" | {100 * (best / base - 1):+.0f}% |")
        md.append("")
    return "\n".join(md) + "\n"


def plot(results: dict, levels: list[int], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6.5 * len(results), 4.8), squeeze=False)
    for ax, (input_len, by_config) in zip(axes[0], results.items()):
        for name, points in by_config.items():
            ax.plot(levels, [points[str(c)]["total_token_throughput"] for c in levels], marker="o", label=name,
                    linestyle="--" if name == "prefill-first" else "-")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency (closed loop)")
        ax.set_ylabel("total token throughput (tok/s)")
        ax.set_title(f"{input_len} in / 100 out", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"simulated: {title}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
