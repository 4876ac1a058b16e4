"""What each fused CPU kernel is worth: decode step time with the kernels turned off one by one.

    .venv/bin/python benchmarks/ablation.py --quantization w8a8 --out docs/results/ablation-w8a8.json

One engine, one run. Configurations, each cumulative on the one before:

1. ``all``: every kernel on (what tandem runs);
2. ``-decode-attention``: decode attention through the gather + SDPA path instead of
   ``decode_attention.c``;
3. ``-fused-layer-ops``: RMS norm, act(gate) * up, and q/k norm + rotary + cache write back to
   the torch operators;
4. ``-argmax``: greedy sampling with ``torch.argmax``.

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
import types
from pathlib import Path

import torch

from tandem import LLM, SamplingParams
from tandem.models import layers
from tandem.runner import attention, sampler

OFF = types.SimpleNamespace(usable=lambda *tensors: False)
CONFIGS = {
    "all": (),
    "-decode-attention": (attention,),
    "-fused-layer-ops": (attention, layers),
    "-argmax": (attention, layers, sampler),
}


def decode_steps(llm: LLM, prompts, params) -> list[float]:
    llm.engine.step_stats.clear()
    llm.generate(prompts, params)
    return [s.duration for s in llm.engine.step_stats if s.kind == "decode"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quantization", default="w8a8", help="none, int8 or w8a8")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--context", type=int, default=256, help="prompt tokens per request")
    ap.add_argument("--decode-steps", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default="docs/results/ablation-w8a8.json")
    args = ap.parse_args()
    llm = LLM(quantization=args.quantization, max_num_seqs=64, max_num_batched_tokens=2048)
    params = SamplingParams(max_tokens=args.decode_steps, temperature=0.0, ignore_eos=True)
    originals = {mod: mod.native for mod in (attention, layers, sampler)}
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        # Distinct token ids per sequence, as benchmarks/roofline.py builds them (speed does not
        # depend on which tokens they are).
        prompts = [[2] + [100 + (i * 7 + j) % 5000 for j in range(args.context - 1)] for i in range(batch)]
        llm.generate(prompts[:1], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))  # warm-up
        steps: dict[str, list[float]] = {name: [] for name in CONFIGS}
        for rnd in range(args.rounds):
            for name, off in CONFIGS.items():
                for mod in originals:
                    mod.native = OFF if mod in off else originals[mod]
                steps[name] += decode_steps(llm, prompts, params)
                print(f"batch {batch:3d} round {rnd + 1}: {name:18s} {statistics.median(steps[name]) * 1e3:8.1f} ms",
                      flush=True)
        for mod, orig in originals.items():
            mod.native = orig
        base = statistics.median(steps["all"])
        for name, values in steps.items():
            med = statistics.median(values)
            rows.append({"batch": batch, "config": name, "decode_step_ms": med * 1e3, "vs_all": med / base,
                         "steps": len(values)})
    print("\n| batch | configuration | decode step (ms) | vs all kernels |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {r['config']} | {r['decode_step_ms']:.1f} | {r['vs_all']:.2f}x |")
    result = {"command": "benchmarks/ablation.py " + " ".join(sys.argv[1:]), "quantization": args.quantization,
              "context": args.context, "threads": torch.get_num_threads(), "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
