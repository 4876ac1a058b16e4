"""Prefill of the default model (its default mode) with one choice of the op table changed at a
time, the variants taking turns in one process so a machine whose speed drifts affects each alike.

    .venv/bin/python benchmarks/prefill_variants.py --out docs/results/amd-epyc-zen5/2026-12-03/prefill-variants.json

Variants (each against ``default``, what the engine chose here; those that cannot differ from it
on this machine are left out, with the reason printed):

* ``sdpa attention``: float32 prompts attend through torch's flash SDPA, not oneDNN matmuls
  (``OpTable.prompt_attention_matmul``, ``prefill_attention`` in ``/config``);
* ``matmul attention``: the reverse, where the default is SDPA;
* ``bf16 attention``: w8a8's bf16-road prompts attend in bf16 (``w8a8_prompt_attention_bf16``;
  chosen only with AMX);
* ``one-call bf16 road``: the bf16 road's matmuls in one plain ``F.linear`` call per chunk instead
  of ``BF16_TILE_ROWS``-row calls with packed weights;
* ``integer prompt rows``: w8a8's prompt rows through the integer kernel, where the default sends
  them down the bf16 road (``w8a8_prompt_matmul`` in ``/config``);
* ``bf16 road``: the reverse, where the default keeps them integer on a CPU with bf16 arithmetic.

Each case (one fresh prompt of L tokens; the budget ``--budget`` cuts longer ones into chunks) is
prefilled once per variant untimed, then ``--rounds`` times per variant with fresh prompt texts (no
prefix cache); the median counts.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F

from tandem import LLM, SamplingParams
from tandem.kernels.cpu_features import cpu_info, cpu_model
from tandem.ops.dispatch import BF16_TILE_ROWS, W8A8_PROMPT_BF16_TOKENS
from tandem.models.layers import Attention
from tandem.models.quant import Int8Linear


class OneCall:
    """The bf16 road without tiles: ``bf16(x) @ weight.T`` in one call, then the scale."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight
        self.device = weight.device

    def __call__(self, x: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        y = F.linear(x.to(torch.bfloat16), self.weight)
        return y if scale is None else y.float().mul_(scale)


def prompt(length: int, seed: int) -> list[int]:
    return [2] + [100 + (seed * 31 + j * 7) % 5000 for j in range(length - 1)]


class Toggles:
    """Sets the model to a variant and back."""

    def __init__(self, runner) -> None:
        model = self.model = runner.model
        self.runner = runner
        self.default_ops = model.ops
        self.w8a8 = any(isinstance(m, Int8Linear) and m.w8a8 for m in model.modules())
        self.attention = [m for m in model.modules() if isinstance(m, Attention)]
        self.road = [m for m in model.modules() if isinstance(m, Int8Linear) and m.w8a8 and m._bf16_weight]
        self.tiled = {id(m): m._bf16_weight for m in self.road}
        self.one_call = {id(m): OneCall(m.weight_rows().to(torch.bfloat16)) for m in self.road}  # [N, K] whatever the kernel layout
        self.default_matmul = model.ops.prompt_attention_matmul
        self.default_bf16 = model.bf16_prompt_attention

    def variants(self) -> dict[str, str]:
        """name: why it is left out ('' when it runs)."""
        bf16_road = self.model.ops.w8a8_prompt_bf16_tokens is not None and self.road
        why_road = "" if bf16_road else "w8a8's bf16 road is off here"
        why_integer = "the model is not w8a8" if not self.w8a8 else ("" if bf16_road else "the default here")
        why_bf16 = ("the model is not w8a8" if not self.w8a8 else "the default here" if bf16_road
                    else "" if cpu_info().bf16_arithmetic else "this CPU has no bf16 arithmetic")
        return {
            "default": "",
            "sdpa attention": "" if self.default_matmul else "the default is SDPA here",
            "matmul attention": "the default is the matmul form here" if self.default_matmul else "",
            "bf16 attention": why_road or ("the default here" if self.default_bf16 else ""),
            "one-call bf16 road": why_road,
            "integer prompt rows": why_integer,
            "bf16 road": why_bf16,
        }

    def use(self, variant: str) -> None:
        tokens = {"integer prompt rows": None, "bf16 road": W8A8_PROMPT_BF16_TOKENS}.get(
            variant, self.default_ops.w8a8_prompt_bf16_tokens)
        self.model.ops = replace(self.default_ops, w8a8_prompt_bf16_tokens=tokens)
        self.runner.prompt_tile = BF16_TILE_ROWS if tokens is not None else 1
        matmul = {"sdpa attention": False, "matmul attention": True}.get(variant, self.default_matmul)
        for m in self.attention:
            m._matmul_prompts = matmul
        self.model.bf16_prompt_attention = True if variant == "bf16 attention" else self.default_bf16
        for m in self.road:
            m._bf16_weight = (self.one_call if variant == "one-call bf16 road" else self.tiled)[id(m)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="256,1024,2000", help="prompt lengths in tokens")
    ap.add_argument("--budget", type=int, default=1024, help="max_num_batched_tokens: longer prompts take several chunks")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default="docs/results/prefill-variants.json")
    args = ap.parse_args()
    lengths = [int(v) for v in args.lengths.split(",")]
    llm = LLM(max_num_seqs=1, max_num_batched_tokens=args.budget, max_model_len=max(2048, max(lengths) + 1),
              enable_prefix_caching=False)
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    llm.generate([prompt(300, 999)], params)  # makes the bf16 road's tiled weights, if it runs
    toggles = Toggles(llm.engine.runner)
    left_out = {v: why for v, why in toggles.variants().items() if why}
    variants = [v for v, why in toggles.variants().items() if not why]
    for v, why in left_out.items():
        print(f"left out: {v} ({why})")
    rows = []
    try:
        for length in lengths:
            for v in variants:
                toggles.use(v)
                llm.generate([prompt(length, 998)], params)
            times: dict[str, list[float]] = {v: [] for v in variants}
            for r in range(args.rounds):
                for v in variants:
                    toggles.use(v)
                    t0 = time.perf_counter()
                    llm.generate([prompt(length, r)], params)
                    times[v].append(time.perf_counter() - t0)
            row = {"tokens": length, "median_ms": {v: statistics.median(t) * 1e3 for v, t in times.items()}}
            row["tok_per_s"] = {v: length / ms * 1e3 for v, ms in row["median_ms"].items()}
            rows.append(row)
            print(f"{length} tokens: " + ", ".join(f"{v} {ms:.1f} ms ({length / ms * 1e3:.0f} tok/s)"
                                                  for v, ms in row["median_ms"].items()), flush=True)
    finally:
        toggles.use("default")
    result = {"command": "benchmarks/prefill_variants.py " + " ".join(sys.argv[1:]), "cpu": cpu_model(),
              "paths": llm.loaded.paths(), "budget": args.budget, "rounds": args.rounds,
              "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "variants": variants, "left_out": left_out,
              "cases": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
