"""`tandem calibrate`: measure what a step costs on this machine and write a measured cost profile.

Two measurements:

1. The forward pass: each step of the designed set (``tandem.sim.design``: prompt chunks,
   decode batches at several contexts, mixed steps) runs on the model runner ``repeats`` times,
   round by round, after one untimed run (its one-time costs), and the median counts. The
   step-time model is fitted to them with its own fit, with the knee that fits best.
2. The engine's time per step beyond the forward pass (scheduling, sampling, detokenizing, the
   loop that feeds it): a short real engine run, where each step's cycle (its start to the next
   step's start) less its forward pass is fitted with the same model.

The designed steps write only into a fresh KV cache no request reads.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import statistics
import time
from pathlib import Path

from tandem.bench.speed_check import check_matches, measure, reference, rescaled, speed_check
from tandem.runner.step_timing import time_steps
from tandem.config import EngineConfig
from tandem.core.sampling_params import SamplingParams
from tandem.core.step import KVLayout
from tandem.kernels.cpu_features import cpu_model
from tandem.sim.design import Spans, compact, design, fit_shapes, relative_errors
from tandem.sim.profile import SCHEMA, profile_from_dict, read_json


def overhead_steps(config: EngineConfig, loaded, num_requests: int, seed: int) -> list[tuple[Spans, float]]:
    """(step, its cycle less its forward pass) over a short run of the chunked policy: prompts of
    16 to 112 random tokens, 16 tokens out each, all sent at once."""
    from tandem.build import engine_for

    engine = engine_for(dataclasses.replace(config, scheduler=dataclasses.replace(
        config.scheduler, policy="chunked", max_num_batched_tokens=128, max_num_seqs=max(8, num_requests // 2))), loaded)
    rng = random.Random(seed)
    vocab = loaded.spec.vocab_size
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    for _ in range(num_requests):
        engine.add_request([rng.randrange(1, vocab) for _ in range(rng.randint(16, 112))], params)
    while engine.has_unfinished_requests():
        engine.step()
    steps = list(engine.step_stats)
    return [(a.spans(), b.start - a.start - a.forward_seconds) for a, b in zip(steps, steps[1:]) if a.chunks]


def run_calibrate(cfg, config: EngineConfig, loaded=None) -> dict:
    """``cfg``: a CalibrateConfig. ``loaded``: a model already loaded (else ``config``'s is)."""
    from rich.progress import Progress

    from tandem.build import load_model, set_threads
    from tandem.runner.runner import ModelRunner, kv_bytes_per_block

    cfg.validate()
    config.validate()
    old = _read_profile(cfg.rescale) if cfg.rescale else None
    if loaded is None:
        set_threads(config.model.threads)
        loaded = load_model(config.model)
    if old is not None:
        return _rescale(cfg, old, loaded)
    per_block = kv_bytes_per_block(loaded.model, config.cache.block_size, loaded.dtype)
    num_blocks = config.cache.num_kv_blocks or int(config.cache.kv_cache_memory_gib * (1 << 30) // per_block)
    layout = KVLayout(num_blocks, config.cache.block_size)
    shapes = design(layout.num_slots, loaded.max_model_len, cfg.max_batch, cfg.max_chunk, layout.block_size)
    runner = ModelRunner(loaded.model, layout, loaded.device, loaded.dtype, config.model.seed)
    with Progress(transient=True) as bar:
        task = bar.add_task("calibrate: designed steps", total=len(shapes))
        timed = time_steps(runner, layout, shapes, cfg.repeats, lambda n: bar.update(task, completed=n))
        del runner  # its KV cache; the overhead run builds its own
        bar.add_task("calibrate: engine overhead", total=None)
        extra = overhead_steps(config, loaded, cfg.overhead_requests, config.model.seed)
        bar.add_task("calibrate: speed check reference", total=None)
        probe = reference(loaded, layout.block_size)
    forward = fit_shapes(timed)
    # what is left of a cycle after the forward pass is small and noisy; a cycle shorter than its
    # forward pass (timer noise) says nothing about it; bookkeeping has no weight-read floor
    overhead = fit_shapes([(s, x) for s, x in extra if x > 0], knees=(0.0,))
    errors = [abs(e) for e in relative_errors(forward, timed)]
    dtype = str(loaded.dtype).removeprefix("torch.")
    machine = _machine(loaded)
    profile = {
        "schema": SCHEMA, "kind": "measured",
        "name": cfg.name or f"{Path(loaded.name).stem} {dtype} {loaded.quantization} on {machine}",
        "forward": dataclasses.asdict(forward), "overhead": dataclasses.asdict(overhead),
        "kv_num_blocks": layout.num_blocks, "block_size": layout.block_size, "max_model_len": loaded.max_model_len,
        "vocab_size": loaded.spec.vocab_size,
        "add_bos": bool(loaded.tokenizer.add_bos_token and loaded.tokenizer.bos_token_id is not None),
        "machine": machine, "device_type": loaded.device.type,
        "model": loaded.name, "dtype": dtype, "quantization": loaded.quantization,
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "speed_probe_ms": probe,
        "fit": {"steps": len(timed), "median_abs_error": statistics.median(errors), "max_abs_error": max(errors),
                "overhead_steps": len(extra), "repeats": cfg.repeats,
                "timed": [{"spans": compact(s), "seconds": x} for s, x in timed]},
    }
    if cfg.device_out:
        _write(Path(cfg.device_out), device_description(loaded, dtype, machine, overhead.base))
    profile_from_dict(profile, "calibrate")  # what is written must load
    _write(Path(cfg.output), profile)
    return profile


def _read_profile(path: str) -> dict:
    d = read_json(Path(path), "rescale")
    profile_from_dict(d, f"rescale: profile {path}")
    return d


def _rescale(cfg, old: dict, loaded) -> dict:
    """The profile ``old``, timed again on a few of its designed steps and scaled to the speed now."""
    check_matches(old, loaded, _machine(loaded))
    profile = rescaled(old, speed_check(old, measure(loaded, old.get("block_size", 16))))
    profile_from_dict(profile, "calibrate")
    _write(Path(cfg.output), profile)
    return profile


def _machine(loaded) -> str:
    return cpu_model() if loaded.device.type == "cpu" else _gpu_name()


def device_description(loaded, dtype: str, machine: str, step_overhead: float) -> dict:
    """A roofline device description of this machine from its measured peaks (they are the best
    rates seen here, so the efficiencies are 1)."""
    from tandem.utilization import measure_peaks

    peaks = measure_peaks(loaded.device.type, dtype if dtype in ("float32", "bfloat16") else "float32")
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {"schema": "tandem-sim-device/1", "name": machine,
            "source": f"measured by tandem calibrate on {time.strftime('%Y-%m-%d')} (best matmul and streaming-read rates)",
            "peak_flops_per_s": {dtype: peaks.flops_per_s}, "memory_bytes_per_s": peaks.bytes_per_s,
            "memory_bytes": float(memory), "compute_efficiency": 1.0, "memory_efficiency": 1.0,
            "step_overhead_s": step_overhead, "kv_memory_fraction": 0.5}


def _gpu_name() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "unknown accelerator"


def _write(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")
