"""What the HTTP layer costs: the same requests through `tandem serve` (streaming, concurrent)
and through the in-process engine, alternated, on the same machine in one run.

    .venv/bin/python benchmarks/http_overhead.py --num-prompts 16 --output-len 64 --rounds 2

Reports, per round, output tokens/s of both paths and the engine's own busy time per output
token (the sum of step durations: in-process from the engine's step records, for the server
from /metrics' tandem:step_duration_seconds_sum). Wall-clock throughput shows the total cost of
HTTP; step time per token shows whether request handling slowed the engine's steps. Writes the
numbers as JSON (--out). Prompts are real ShareGPT first turns when the dataset is found,
cut to --input-len tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import sys
import time
from pathlib import Path

import httpx

from tandem.bench.launch import ServerProcess, free_port

ROOT = Path(__file__).resolve().parent.parent
DATASET = ROOT.parent / "shared" / "datasets" / "sharegpt_v3_first_turn_1000.json"
FALLBACK_TEXT = (
    "The history of computing is a story of layered abstractions, each hiding the one beneath it. "
    "Engineers who build inference servers care about the cost of every layer between a request and "
    "the arithmetic that answers it, because at scale a few percent is a lot of machines. "
) * 20


def load_prompts(tokenizer, n: int, input_len: int) -> list[list[int]]:
    texts = []
    if DATASET.is_file():
        for item in json.loads(DATASET.read_text()):
            turns = item.get("conversations") or []
            if turns and turns[0].get("from") == "human":
                texts.append(turns[0]["value"])
    prompts = []
    for text in texts:
        ids = tokenizer.encode(text)
        if len(ids) >= input_len:
            prompts.append(ids[:input_len])
        if len(prompts) == n:
            return prompts
    base = tokenizer.encode(FALLBACK_TEXT)
    while len(prompts) < n:
        prompts.append(base[len(prompts) : len(prompts) + input_len])
    return prompts




async def fire(url: str, prompts: list[list[int]], output_len: int) -> tuple[float, int]:
    async def one(client: httpx.AsyncClient, prompt: list[int]) -> int:
        body = {"prompt": prompt, "max_tokens": output_len, "temperature": 0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        tokens = 0
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    usage = json.loads(line[6:]).get("usage")
                    if usage:
                        tokens = usage["completion_tokens"]
        return tokens

    limits = httpx.Limits(max_connections=len(prompts) + 4)
    async with httpx.AsyncClient(timeout=None, limits=limits) as client:
        start = time.perf_counter()
        counts = await asyncio.gather(*(one(client, p) for p in prompts))
        return time.perf_counter() - start, sum(counts)


def step_seconds(url: str) -> float:
    """Total engine step time so far, from the server's Prometheus histogram."""
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("tandem:step_duration_seconds_sum"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--policy", default="chunked")
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--out", default=str(ROOT / "docs" / "results" / "http_overhead.json"))
    args = ap.parse_args()

    from tandem import LLM, SamplingParams

    engine_kwargs = dict(policy=args.policy, max_num_batched_tokens=args.max_num_batched_tokens,
                         max_num_seqs=max(args.num_prompts, 1))
    llm = LLM(args.model, **engine_kwargs)
    prompts = load_prompts(llm.tokenizer, args.num_prompts, args.input_len)
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0))  # warm-up

    port = free_port()
    cmd = [sys.executable, "-m", "tandem.cli", "serve", "--port", str(port),
           "--policy", args.policy, "--max-num-batched-tokens", str(args.max_num_batched_tokens),
           "--max-num-seqs", str(max(args.num_prompts, 1))]
    if args.model:
        cmd += ["--model", args.model]
    url = f"http://127.0.0.1:{port}"
    server = ServerProcess(cmd, url)
    try:
        asyncio.run(fire(url, prompts[:2], 4))  # warm-up
        rows = []
        for r in range(args.rounds):
            # The server's engine thread idles while the in-process engine runs, and vice versa.
            llm.engine.step_stats.clear()
            t = time.perf_counter()
            outs = llm.generate(prompts, params)
            inproc_s = time.perf_counter() - t
            inproc_tokens = sum(len(o.token_ids) for o in outs)
            inproc_busy = sum(s.duration for s in llm.engine.step_stats)
            before = step_seconds(url)
            server_s, server_tokens = asyncio.run(fire(url, prompts, args.output_len))
            server_busy = step_seconds(url) - before
            rows.append({
                "round": r + 1,
                "in_process_tok_s": inproc_tokens / inproc_s,
                "server_tok_s": server_tokens / server_s,
                "in_process_step_ms_per_token": 1000 * inproc_busy / inproc_tokens,
                "server_step_ms_per_token": 1000 * server_busy / server_tokens,
                "in_process_tokens": inproc_tokens,
                "server_tokens": server_tokens,
            })
            row = rows[-1]
            print(f"round {r + 1}: in-process {row['in_process_tok_s']:.1f} tok/s "
                  f"({row['in_process_step_ms_per_token']:.1f} ms of steps per token), server "
                  f"{row['server_tok_s']:.1f} tok/s ({row['server_step_ms_per_token']:.1f} ms)", flush=True)
    finally:
        server.stop(timeout=30, sig=signal.SIGTERM)
    ratio = statistics.median(row["server_tok_s"] / row["in_process_tok_s"] for row in rows)
    step_ratio = statistics.median(row["server_step_ms_per_token"] / row["in_process_step_ms_per_token"]
                                   for row in rows)
    result = {
        "command": "benchmarks/http_overhead.py " + " ".join(sys.argv[1:]),
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "threads": os.cpu_count(),
        "rounds": rows,
        "median_ratio_server_over_in_process": ratio,
        "median_step_time_ratio_server_over_in_process": step_ratio,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"\nserver / in-process output throughput (median of {args.rounds} rounds): {ratio:.3f} "
          f"({(1 - ratio) * 100:+.1f}% overhead)")
    print(f"server / in-process engine step time per token (median): {step_ratio:.3f}")


if __name__ == "__main__":
    main()
