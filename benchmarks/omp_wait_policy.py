"""Decode and prefill step times under OpenMP's default wait policy and under
``OMP_WAIT_POLICY=PASSIVE``, each in a fresh process (the variable is read when OpenMP starts).
PASSIVE keeps idle worker threads from spinning, which helps when another process shares the
cores, at the price of waking them for every parallel region.

    .venv/bin/python benchmarks/omp_wait_policy.py --rounds 2 --out docs/results/amd-epyc-zen5/omp-wait-policy.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import json, random, statistics, time
from tandem import LLM, SamplingParams
llm = LLM(max_model_len=2048, enable_prefix_caching=False)
rng = random.Random(0)
ids = [2] + [rng.randrange(1000, 50000) for _ in range(1023)]
one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
many = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
llm.generate(ids, one)
prefill = []
for _ in range(3):
    t = time.perf_counter(); llm.generate(ids, one); prefill.append(time.perf_counter() - t)
def gap(out, skip):
    tt = out.timing.token_times
    return (tt[-1] - tt[skip]) / (len(tt) - 1 - skip)
b1 = [gap(llm.generate([2, 100, 200], many)[0], 0) for _ in range(3)]
b16 = [gap(llm.generate([[2, 100 + i, 200] for i in range(16)], many)[0], 5) for _ in range(2)]
print(json.dumps({"prefill_1024_ms": statistics.median(prefill) * 1e3, "decode_b1_ms": statistics.median(b1) * 1e3,
                  "decode_b16_ms": statistics.median(b16) * 1e3}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2, help="alternating runs of each setting")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    from tandem.kernels.cpu_features import cpu_model

    rows = []
    for r in range(args.rounds):
        for policy in ("default", "PASSIVE"):
            env = dict(os.environ)
            env.pop("OMP_WAIT_POLICY", None)
            if policy != "default":
                env["OMP_WAIT_POLICY"] = policy
            out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, check=True)
            row = {"round": r, "omp_wait_policy": policy, **json.loads(out.stdout.strip().splitlines()[-1])}
            rows.append(row)
            print(f"{policy:8s} prefill 1024 tokens {row['prefill_1024_ms']:.0f} ms, decode batch 1 "
                  f"{row['decode_b1_ms']:.2f} ms/token, batch 16 {row['decode_b16_ms']:.2f} ms/step", flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"cpu": cpu_model(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
