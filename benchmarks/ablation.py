"""What each fused CPU kernel is worth: decode step time with the kernels turned off one by one.

    .venv/bin/python benchmarks/ablation.py --quantization w8a8 --out docs/results/ablation-w8a8.json

One model per configuration (its ops chosen by ``tandem.ops.dispatch.select_ops`` with the
named ops disabled), one run. Configurations, each cumulative on the one before:

1. ``all``: every kernel on (what tandem runs);
2. ``-decode-layers``: a decode step's layers op by op from Python instead of in one C call
   (``decode_layers.c``; w8a8 only, so with other weight formats 1 and 2 are the same);
3. ``-decode-attention``: decode attention through the gather + SDPA path instead of
   ``decode_attention.c``;
4. ``-fused-layer-ops``: RMS norm, act(gate) * up, and q/k norm + rotary + cache write back to
   the torch operators;
5. ``-argmax``: greedy sampling with ``torch.argmax``.

The int8 matmul kernels stay on throughout (benchmarks/int8_kernel.py measures them). For each
batch size, every configuration runs the same greedy requests (prompts of --context tokens;
--decode-steps output tokens); the configurations take turns, --rounds times, and
each figure is the median decode step over all its rounds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

from tandem import SamplingParams
from tandem.build import engine_for, load_model, resolve_device, resolve_dtype, set_threads
from tandem.config import EngineConfig
from tandem.core.engine import Engine
from tandem.llm import generate
from tandem.ops.dispatch import select_ops

CONFIGS = {
    "all": (),
    "-decode-layers": ("decode_layers",),
    "-decode-attention": ("decode_layers", "decode_attention"),
    "-fused-layer-ops": ("decode_layers", "decode_attention", "rms_norm", "act_mul", "qkv_rope_cache"),
    "-argmax": ("decode_layers", "decode_attention", "rms_norm", "act_mul", "qkv_rope_cache", "argmax"),
}


def decode_steps(engine: Engine, prompts, params) -> list[float]:
    engine.step_stats.clear()
    generate(engine, prompts, params)
    return [s.duration for s in engine.step_stats if s.kind == "decode"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quantization", default="w8a8", help="none, int8 or w8a8")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--context", type=int, default=256, help="prompt tokens per request")
    ap.add_argument("--decode-steps", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default="docs/results/ablation-w8a8.json")
    args = ap.parse_args()
    config = EngineConfig.from_kwargs(quantization=args.quantization, max_num_seqs=64, max_num_batched_tokens=2048)
    set_threads(config.model.threads)
    device = resolve_device(config.model.device)
    dtype = resolve_dtype(config.model.dtype, device)
    if args.quantization != "none" and config.model.dtype == "auto":
        dtype = torch.float32  # as load_model does: the int8 kernels take float32 activations
    loaded = {name: load_model(config.model, select_ops(device, dtype, disable=off)) for name, off in CONFIGS.items()}
    engines = {name: engine_for(config, m) for name, m in loaded.items()}
    params = SamplingParams(max_tokens=args.decode_steps, temperature=0.0, ignore_eos=True)
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        # Distinct token ids per sequence, as benchmarks/roofline.py builds them (speed does not
        # depend on which tokens they are).
        prompts = [[2] + [100 + (i * 7 + j) % 5000 for j in range(args.context - 1)] for i in range(batch)]
        for engine in engines.values():  # warm-up
            generate(engine, prompts[:1], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
        steps: dict[str, list[float]] = {name: [] for name in CONFIGS}
        for rnd in range(args.rounds):
            for name, engine in engines.items():
                steps[name] += decode_steps(engine, prompts, params)
                print(f"batch {batch:3d} round {rnd + 1}: {name:18s} {statistics.median(steps[name]) * 1e3:8.1f} ms",
                      flush=True)
        base = statistics.median(steps["all"])
        for name, values in steps.items():
            med = statistics.median(values)
            rows.append({"batch": batch, "config": name, "decode_step_ms": med * 1e3, "vs_all": med / base,
                         "steps": len(values)})
    print("\n| batch | configuration | decode step (ms) | vs all kernels |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {r['config']} | {r['decode_step_ms']:.1f} | {r['vs_all']:.2f}x |")
    result = {"command": "benchmarks/ablation.py " + " ".join(sys.argv[1:]), "quantization": args.quantization,
              "paths": {name: m.paths() for name, m in loaded.items()},
              "context": args.context, "threads": torch.get_num_threads(), "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
