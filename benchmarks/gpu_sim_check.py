"""The simulator against a real GPU, in one run of under 10 minutes, with no download: the engine
on CUDA with a randomly initialised Llama-3.1-8B-shaped model in bf16 (outputs are noise; step
times are the point), TNG's equal-size case (1500 prompt / 100 output tokens) at three
concurrencies for prefill-first and chunked, a profile calibrated from the same model, and
measured against simulated (that profile, and the shipped roofline of the GPU it names).

    .venv/bin/python benchmarks/gpu_sim_check.py --out docs/results/sim-gpu-check
    .venv/bin/python benchmarks/gpu_sim_check.py --out /tmp/check --roofline h100-sxm/llama-3.1-8b

Without CUDA it stops at once and says so. A point that would start past --budget-s seconds is
skipped and recorded as skipped, so the run ends in time on a slower GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

CONFIGS = {
    "prefill-first": {"policy": "prefill-first", "max_num_batched_tokens": 8192},
    "chunked 512": {"policy": "chunked", "max_num_batched_tokens": 512},
    "chunked 2048": {"policy": "chunked", "max_num_batched_tokens": 2048},
}


def random_llama(max_len: int, spec_path: Path, device_name: str = "cuda"):
    """A LoadedModel of the spec's shape (Llama-3.1-8B's by default) in bf16, weights drawn at random."""
    import torch

    from tandem.build import LoadedModel
    from tandem.models.registry import instantiate, randomize
    from tandem.models.spec import ModelSpec
    from tandem.ops.dispatch import select_ops
    from tandem.sim import SimTokenizer

    spec = ModelSpec.from_hf_config(json.loads(spec_path.read_text()))
    device, dtype = torch.device(device_name), torch.bfloat16
    model = randomize(instantiate(spec, max_len, device, dtype, select_ops(device, dtype, "auto")))
    model.eval()
    # prompts are t<id> words: the simulator's tokenizer reads them back as exactly those ids
    return LoadedModel(model, SimTokenizer(spec.vocab_size), spec, "llama-3.1-8b (random weights)", max_len,
                       device, dtype)


class RealEvaluator:
    def __init__(self, config, loaded) -> None:
        self.config = config
        self.loaded = loaded

    def engine(self, overrides: dict):
        from tandem.build import engine_for

        scheduler = dataclasses.replace(self.config.scheduler, **overrides)
        return engine_for(dataclasses.replace(self.config, scheduler=scheduler), self.loaded)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--input-len", type=int, default=1500)
    ap.add_argument("--output-len", type=int, default=100)
    ap.add_argument("--concurrency", default="4,16,32")
    ap.add_argument("--waves", type=int, default=2, help="requests per point: this many times the concurrency")
    ap.add_argument("--kv-gib", type=float, default=24.0)
    ap.add_argument("--roofline", default=None, help="DEVICE/MODEL to simulate beside the calibrated profile "
                    "(default: h200/llama-3.1-8b on an H200, h100-sxm/llama-3.1-8b otherwise)")
    ap.add_argument("--budget-s", type=float, default=480.0)
    ap.add_argument("--spec", default=None, help="a config.json to shape the model (default: the shipped Llama-3.1-8B)")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                    help="cpu only checks this script itself, with a small --spec")
    args = ap.parse_args(argv)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_sim_check: no CUDA device here; this check needs one (nothing was run)", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    from sim_tng import run_point

    from tandem.bench.calibrate import run_calibrate
    from tandem.bench.config import CalibrateConfig
    from tandem.bench.simulate import SimEvaluator
    from tandem.config import EngineConfig
    from tandem.kernels.cpu_features import cpu_model
    from tandem.sim.profile import SHIPPED, describe, load_profile

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else cpu_model()
    roofline = args.roofline or ("h200/llama-3.1-8b" if "H200" in gpu else "h100-sxm/llama-3.1-8b")
    max_len = args.input_len + args.output_len + 64
    spec_path = Path(args.spec) if args.spec else SHIPPED / "models" / "llama-3.1-8b.json"
    loaded = random_llama(max_len if args.spec else max(max_len, 8192), spec_path, args.device)
    config = EngineConfig.from_kwargs(device=args.device, dtype="bfloat16", kv_cache_memory_gib=args.kv_gib,
                                      max_num_seqs=256)
    print(f"model ready on {gpu} after {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    run_calibrate(CalibrateConfig(output=str(out / "profile.json"), repeats=3, max_chunk=min(8192, loaded.max_model_len), max_batch=64,
                                  overhead_requests=16), config, loaded=loaded)
    print(f"calibrated after {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    evaluators = {"measured": RealEvaluator(config, loaded),
                  "sim (calibrated)": SimEvaluator(load_profile(str(out / "profile.json")), config.scheduler),
                  f"sim ({roofline})": SimEvaluator(load_profile(roofline), config.scheduler)}
    levels = [int(v) for v in args.concurrency.split(",")]
    results: dict = {}
    for name, overrides in CONFIGS.items():
        for c in levels:
            key = f"{name} c={c}"
            if time.perf_counter() - t0 > args.budget_s:
                results[key] = {"skipped": f"past the {args.budget_s:.0f} s budget"}
                continue
            results[key] = {ev: run_point(e, overrides, args.input_len, args.output_len, c, args.waves, 0,
                                          loaded.spec.vocab_size, min_requests=2 * c)
                            for ev, e in evaluators.items()}
            m = results[key]["measured"]["total_token_throughput"]
            print(f"{key}: measured {m:,.0f} tok/s, " + ", ".join(
                f"{ev} {r['total_token_throughput']:,.0f}" for ev, r in results[key].items() if ev != "measured"),
                file=sys.stderr, flush=True)
    meta = {"gpu": gpu, "model": loaded.name, "input_len": args.input_len, "output_len": args.output_len,
            "profiles": {ev: describe(e.profile) for ev, e in evaluators.items() if hasattr(e, "profile")},
            "seconds": round(time.perf_counter() - t0), "date": time.strftime("%Y-%m-%d %H:%M"),
            "command": "benchmarks/gpu_sim_check.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    (out / "gpu_sim_check.json").write_text(json.dumps({**meta, "results": results}, indent=1) + "\n")
    (out / "gpu_sim_check.md").write_text(markdown(results, meta))
    print((out / "gpu_sim_check.md").read_text())
    return 0


METRICS = (("total_token_throughput", "total tok/s"), ("p50_ttft_ms", "TTFT p50 ms"), ("p99_itl_ms", "ITL p99 ms"))


def markdown(results: dict, meta: dict) -> str:
    md = [f"# The simulator against {meta['gpu']}", "",
          f"{meta['model']}, {meta['input_len']} prompt / {meta['output_len']} output tokens, closed loop; "
          f"{meta['seconds']} s in all.", "", f"    {meta['command']}", ""]
    md += [f"- {ev}: {d}" for ev, d in meta["profiles"].items()] + [""]
    evs = [ev for r in results.values() if "skipped" not in r for ev in r][:3]
    head = " | ".join(f"{name}: {ev}" for _, name in METRICS for ev in evs)
    md += [f"| point | {head} |", "|---" * (1 + len(METRICS) * len(evs)) + "|"]
    for key, r in results.items():
        if "skipped" in r:
            md.append(f"| {key} | skipped: {r['skipped']} |")
            continue
        cells = []
        for metric, _ in METRICS:
            real = r["measured"][metric]
            for ev in evs:
                v = r[ev][metric]
                cells.append(f"{v:,.0f}" if ev == "measured" else f"{v:,.0f} ({100 * (v / real - 1):+.0f}%)")
        md.append(f"| {key} | " + " | ".join(cells) + " |")
    return "\n".join(md) + "\n"


if __name__ == "__main__":
    sys.exit(main())
