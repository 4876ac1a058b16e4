"""The engine against this machine's own limits, measured in one run.

    .venv/bin/python benchmarks/roofline.py --out docs/results/roofline.json
    .venv/bin/python benchmarks/roofline.py --quantization int8 --out docs/results/roofline-int8.json
    .venv/bin/python benchmarks/roofline.py --quantization w8a8 --out docs/results/roofline-w8a8.json

1. Peaks: matmul FLOP/s per dtype (a large square shape and the skinny decode shape of the output
   layer) and memory read bandwidth.
2. Decode step time vs batch size (and two context lengths), against the roofline floor:
   max(weights + KV read / bandwidth, FLOPs / peak FLOP/s). On a machine whose read bandwidth
   moves (a shared VM), the run's peak may be from another minute than a row's steps: each row
   also reads the bandwidth right before and right after its steps, and gives the floor at the
   larger of those two (``floor_now_ms``, ``of_roofline_now``).
3. Prefill throughput vs chunk size, against the compute floor.
4. Engine overhead per step: step time outside the model's forward pass and output layer
   (scheduling, batch and attention-metadata building, sampling, detokenization), as a share
   of the step.
5. Engine start time: building the engine from the cached converted model (with int8, the
   quantization at load is included).
Every figure is a ratio measured in this run; medians of repeated steps.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from tandem import LLM, SamplingParams
from tandem.utilization import measure_bandwidth, measure_peaks

STEP_TOKENS = 4096
"""The engine's token budget per step here (max_num_batched_tokens)."""


def matmul_flops(m: int, k: int, n: int, dtype: torch.dtype, seconds: float = 0.5) -> float:
    a = torch.randn(m, k).to(dtype)
    w = torch.randn(n, k).to(dtype)
    best = 0.0
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        t = time.perf_counter()
        torch.nn.functional.linear(a, w)
        best = max(best, 2 * m * k * n / (time.perf_counter() - t))
    return best


def median_step(llm: LLM, prompts, params, kind: str) -> tuple[float, float]:
    """Median duration and median non-forward time of the steps of one kind in a generate call
    that carried every prompt (a decode step of fewer sequences is not a step of this batch)."""
    llm.engine.step_stats.clear()
    llm.generate(prompts, params)
    steps = [s for s in llm.engine.step_stats if s.kind == kind and s.num_seqs == len(prompts)]
    if not steps:
        raise SystemExit(f"no {kind} step carried all {len(prompts)} sequences (KV cache too small?)")
    steps = steps[len(steps) // 4:] or steps  # skip the ramp
    return statistics.median(s.duration for s in steps), statistics.median(s.duration - s.forward_seconds
                                                                          for s in steps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantization", default="auto",
                    help="auto (what tandem runs by default), none, int8 (weight-only int8) or w8a8 (int8 weights and inputs)")
    ap.add_argument("--batches", default="1,4,16,32,64")
    ap.add_argument("--contexts", default="128,512")
    ap.add_argument("--chunks", default="64,256,1024")
    ap.add_argument("--decode-steps", type=int, default=12)
    ap.add_argument("--out", default="docs/results/roofline.json")
    args = ap.parse_args()
    torch.set_num_threads(torch.get_num_threads())

    started = time.perf_counter()
    # no prefix cache: each chunk size prefills the same prompt, which must be computed every time
    batches = [int(x) for x in args.batches.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    # room for the largest batch at the longest context, so its steps carry every sequence
    kv_tokens = max(batches) * (max(contexts) + args.decode_steps + 16) + STEP_TOKENS
    llm = LLM(dtype=args.dtype, quantization=args.quantization, max_num_seqs=max(64, max(batches)),
              max_num_batched_tokens=STEP_TOKENS, max_model_len=2048, enable_prefix_caching=False,
              num_kv_blocks=-(-kv_tokens // 16), block_size=16)
    load_s = time.perf_counter() - started
    spec, dtype = llm.loaded.spec, llm.loaded.dtype
    dtype_name = "bfloat16" if dtype == torch.bfloat16 else "float32"
    # with w8a8 weights the compute floor is the integer matmul's, not float32's
    peaks = measure_peaks("cpu", dtype_name, seconds=2.0, w8a8_kernels=llm.loaded.w8a8_kernels,
                          bf16_prompts=llm.loaded.w8a8_bf16_prompts)
    # decode rows always run the integer kernel: their floor uses its peak, not bf16's
    decode_peaks = (measure_peaks("cpu", dtype_name, seconds=2.0, w8a8_kernels=llm.loaded.w8a8_kernels)
                    if llm.loaded.w8a8_bf16_prompts else peaks)
    result: dict = {"command": "benchmarks/roofline.py " + " ".join(sys.argv[1:]), "dtype": dtype_name,
                    "quantization": llm.loaded.quantization, "threads": torch.get_num_threads(),
                    "start_s": load_s, "paths": llm.loaded.paths(),
                    "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    print(f"paths: {llm.loaded.paths_line()}", flush=True)
    print(f"engine start (model from the converted cache): {load_s:.1f} s", flush=True)
    result["peaks"] = {
        "matmul_gflops_1024": peaks.flops_per_s / 1e9,
        "matmul_kind": ("w8a8 (int8 products) or bf16 (prompt rows), the faster" if llm.loaded.w8a8_bf16_prompts
                        else "w8a8 (int8 products)" if llm.loaded.w8a8_kernels is not None else dtype_name),
        "bandwidth_gb_s": peaks.bytes_per_s / 1e9,
        "decode_matmul_gflops_1024": decode_peaks.flops_per_s / 1e9,
        "output_layer_gflops_by_rows": {rows: matmul_flops(rows, spec.hidden_size, spec.vocab_size, dtype) / 1e9
                                        for rows in (1, 16, 64)},
    }
    print(json.dumps(result["peaks"], indent=1), flush=True)
    cost = llm.loaded.cost()

    decode = []
    for ctx in contexts:
        for b in batches:
            prompts = [[2] + [100 + (i * 7 + j) % 5000 for j in range(ctx - 1)] for i in range(b)]
            # the first prompts decode while the last are prefilled: enough tokens that every
            # sequence still decodes for --decode-steps steps once all are in
            prefill_steps = -(-b * ctx // STEP_TOKENS)
            params = SamplingParams(max_tokens=args.decode_steps + prefill_steps, temperature=0, ignore_eos=True)
            before = measure_bandwidth("cpu")
            step, overhead = median_step(llm, prompts, params, "decode")
            now = max(before, measure_bandwidth("cpu"))
            flops, nbytes = cost.step([(ctx + args.decode_steps // 2, 1)] * b, b)
            floor = max(nbytes / peaks.bytes_per_s, flops / decode_peaks.flops_per_s)
            floor_now = max(nbytes / now, flops / decode_peaks.flops_per_s)
            row = {"context": ctx, "batch": b, "step_ms": step * 1e3, "floor_ms": floor * 1e3,
                   "of_roofline": floor / step, "bandwidth_now_gb_s": now / 1e9, "floor_now_ms": floor_now * 1e3,
                   "of_roofline_now": floor_now / step, "tok_s": b / step, "overhead_share": overhead / step}
            decode.append(row)
            print(f"decode ctx={ctx} batch={b}: {row['step_ms']:.1f} ms/step (floor {row['floor_ms']:.1f} ms, "
                  f"{100 * row['of_roofline']:.0f}% of roofline; at the {row['bandwidth_now_gb_s']:.0f} GB/s read "
                  f"around it {row['floor_now_ms']:.1f} ms, {100 * row['of_roofline_now']:.0f}%), "
                  f"{row['tok_s']:.1f} tok/s, overhead {100 * row['overhead_share']:.1f}%", flush=True)
    result["decode"] = decode

    prefill = []
    prompt = [2] + [100 + j % 5000 for j in range(2047 - 16)]
    for chunk in (int(c) for c in args.chunks.split(",")):
        sched = llm.engine.scheduler
        sched.config = dataclasses.replace(sched.config, max_num_batched_tokens=chunk)
        llm.engine.step_stats.clear()
        t = time.perf_counter()
        llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0))
        steps = [s for s in llm.engine.step_stats if s.num_prefill_tokens]
        seconds = sum(s.duration for s in steps)
        flops = sum(cost.step(s.spans(), s.num_sampled)[0] for s in steps)
        row = {"chunk": chunk, "tok_s": len(prompt) / seconds, "of_compute_peak": flops / seconds / peaks.flops_per_s,
               "steps": len(steps), "wall_s": time.perf_counter() - t}
        prefill.append(row)
        print(f"prefill chunk={chunk}: {row['tok_s']:.0f} tok/s, {100 * row['of_compute_peak']:.0f}% of peak FLOP/s",
              flush=True)
    result["prefill"] = prefill
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
