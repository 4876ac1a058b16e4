"""The int8 and int4 matmul paths against float32 BLAS on the default model's matmul shapes.

    .venv/bin/python benchmarks/int8_kernel.py --out docs/results/int8_kernel.json
    .venv/bin/python benchmarks/int8_kernel.py --kinds int4 --out /tmp/int4_kernel.json

For each weight shape (N x K) of Gemma 3 270M and each row count M: float32 ``F.linear``; with
``int8`` in ``--kinds``, the weight-only int8 kernel of each kernel variant this CPU runs
(``tandem.kernels``), the blocked dequantize + BLAS path and the w8a8 kernel (inputs rounded to
int8, integer products); with ``int4``, the int4 kernel and its blocked path. Best of repeated
calls (this machine is shared; the minimum is the least disturbed). The row count where a
weight-only kernel stops beating its blocked path sets its ``KernelRows`` (``quant.INT8_ROWS``,
``quant_int4.INT4_ROWS``). Each call reads one weight that is already in cache for the small
shapes: see benchmarks/roofline.py for whole steps.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from tandem.kernels import native
from tandem.kernels.cpu_features import cpu_info
from tandem.models import quant, quant_int4

SHAPES = {"qkv": (1536, 640), "o": (640, 1024), "gate_up": (4096, 640), "down": (640, 2048),
          "head": (262144, 640)}


def best_ms(fn, seconds: float) -> float:
    fn()
    best = float("inf")
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def blocked_ms(fn, budget: float) -> float:
    """``fn`` timed with every quantized matmul sent down the dequantize + BLAS path."""
    saved, quant.use_kernel = quant.use_kernel, lambda *args: False
    try:
        return best_ms(fn, budget)
    finally:
        quant.use_kernel = saved


def time_shape(lib: native.Kernels, name: str, n: int, k: int, args) -> list[dict]:
    w = torch.randn(n, k) * 0.05
    kinds = args.kinds.split(",")
    q, s = quant.quantize_rows(w) if "int8" in kinds else (None, None)
    p4, s4 = quant_int4.quantize_groups(w) if "int4" in kinds else (None, None)
    rows = []
    for m in (int(r) for r in args.rows.split(",")):
        x = torch.randn(m, k)
        budget = args.seconds * (4 if name == "head" else 1)
        row = {"variant": lib.isa.name, "shape": name, "n": n, "k": k, "rows": m,
               "fp32_ms": best_ms(lambda: F.linear(x, w), budget)}
        line = f"{lib.isa.name:7s} {name:8s} {n:6d}x{k:<5d} M={m:<4d} fp32 {row['fp32_ms']:8.3f} ms"
        if "int8" in kinds:
            row["int8_kernel_ms"] = kernel = best_ms(lambda: lib.gemm_i8(x, q, s), budget)
            row["int8_blocked_ms"] = blocked_ms(lambda: quant.int8_matmul(x, q, s, kernels=lib), budget)
            qk = lib.w8a8_weight(q)  # packed where this variant multiplies on AMX tiles
            row["w8a8_kernel_ms"] = w8a8 = best_ms(lambda: lib.gemm_w8a8(x, qk, s), budget)
            row["kernel_weight_gb_s"] = n * k / kernel / 1e6
            row["w8a8_gop_s"] = 2 * m * n * k / w8a8 / 1e6
            line += (f"  int8 kernel {kernel:8.3f} ms  blocked {row['int8_blocked_ms']:8.3f} ms  "
                     f"w8a8 {w8a8:8.3f} ms")
        if "int4" in kinds:
            row["int4_kernel_ms"] = kernel = best_ms(lambda: lib.gemm_i4(x, p4, s4), budget)
            row["int4_blocked_ms"] = blocked_ms(lambda: quant_int4.int4_matmul(x, p4, s4, k, kernels=lib), budget)
            row["int4_kernel_gb_s"] = n * k * quant_int4.BYTES_PER_WEIGHT / kernel / 1e6
            line += (f"  int4 kernel {kernel:8.3f} ms ({row['int4_kernel_gb_s']:5.1f} GB/s)  "
                     f"blocked {row['int4_blocked_ms']:8.3f} ms")
        rows.append(row)
        print(line, flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,4,16,32,64,128,256")
    ap.add_argument("--seconds", type=float, default=0.4, help="time budget per measurement")
    ap.add_argument("--variants", default=None,
                    help="kernel variants to time, comma-separated (default: every one this CPU runs)")
    ap.add_argument("--kinds", default="int8", help="weight formats to time, comma-separated: int8, int4")
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"of {', '.join(SHAPES)}")
    ap.add_argument("--out", default="docs/results/int8_kernel.json")
    args = ap.parse_args()
    if not native.available():
        sys.exit("the native kernels are not available here (no C compiler or no AVX2)")
    names = args.variants.split(",") if args.variants else [v.name for v in native.supported_variants()]
    rows = []
    for variant in names:
        lib = native.load(variant)
        for name in args.shapes.split(","):
            rows += time_shape(lib, name, *SHAPES[name], args)
    result = {"command": "benchmarks/int8_kernel.py " + " ".join(sys.argv[1:]), "threads": torch.get_num_threads(),
              "cpu": cpu_info().describe(), "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
