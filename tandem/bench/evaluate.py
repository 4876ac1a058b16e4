"""One engine configuration (a candidate) measured on a workload: a fresh engine over a shared
model, the same requests at the same times, so candidates differ only by their scheduling
settings. `tandem compare` and `tandem tune` both measure through here."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from tandem.bench.replay import RunData, run_inprocess
from tandem.bench.summary import summarize_run
from tandem.bench.prompts import BenchRequest
from tandem.bench.config_keys import parse_overrides, refuse_routing
from tandem.bench.workload import ArrivalSpec
from tandem.config import EngineConfig, SchedulerConfig



@dataclass
class Candidate:
    name: str
    overrides: dict[str, Any]

    @classmethod
    def parse(cls, text: str, fields_of: type = SchedulerConfig) -> "Candidate":
        """``"policy=chunked,max_num_batched_tokens=256"`` (an optional ``name:`` first); values
        take their SchedulerConfig field's type."""
        name, sep, rest = text.partition(":")
        if not sep or "=" in name:
            name, rest = "", text
        overrides = parse_overrides(rest, fields_of)
        return cls(name or describe(overrides), overrides)


_SHOWN = ("policy", "max_num_batched_tokens", "max_num_seqs", "long_prefill_token_threshold",
          "max_long_partial_prefills")


def describe(o: dict[str, Any]) -> str:
    text = o.get("policy", "chunked")
    if o.get("target_itl_ms"):
        text += f" itl<={o['target_itl_ms']:g}ms"
    elif text == "chunked" and o.get("itl_target_factor"):
        text += f" itl<={o['itl_target_factor']:g}x"
    if "max_num_batched_tokens" in o:
        text += f" chunk={o['max_num_batched_tokens']}" if text.startswith("chunked") else \
            f" budget={o['max_num_batched_tokens']}"
    if text.startswith("chunked") and not o.get("target_itl_ms") and o.get("itl_target_factor", 1) == 0:
        text += " fixed"  # no ITL target sizes its prefill
    if "max_num_seqs" in o:
        text += f" seqs={o['max_num_seqs']}"
    if o.get("long_prefill_token_threshold"):
        text += f" cap={o['long_prefill_token_threshold']}x{o.get('max_long_partial_prefills', 0) or 'inf'}"
    if o.get("target_ttft_ms"):
        text += f" ttft<={o['target_ttft_ms']:g}ms"
    for key, value in o.items():
        if key not in _SHOWN and key not in ("target_itl_ms", "target_ttft_ms", "itl_target_factor") \
                and value not in (None, ""):
            text += f" {value}" if key == "fairness" else f" {key}={value}"
    return text


@dataclass
class Evaluation:
    candidate: Candidate
    summary: dict
    data: RunData
    steps: list
    preemptions: int
    mfu: float | None = None
    mbu: float | None = None
    server: dict | None = None
    """A launched server's trial: its command, log file, and error and log tail if it failed."""
    replicas: dict | None = None
    """A simulation of replicas behind a router: requests and prefix blocks per replica."""
    runs: list[dict] | None = None
    """Each run's figures when the configuration ran several times (``tandem.bench.repeats``);
    ``summary`` then holds their medians."""


class InProcessEvaluator:
    """Runs candidates on fresh engines over one loaded model."""

    def __init__(self, base: EngineConfig, peaks=None, prompt_tokenizer=None) -> None:
        from tandem.build import load_model, set_threads
        from tandem.utilization import measure_peaks

        set_threads(base.model.threads)
        self.base = base
        self.loaded = load_model(base.model)
        self.prompt_tokenizer = prompt_tokenizer
        self.cost = self.loaded.cost()
        dtype = "bfloat16" if str(self.loaded.dtype) == "torch.bfloat16" else "float32"
        self.peaks = peaks or measure_peaks(self.loaded.device.type, dtype, w8a8_kernels=self.loaded.w8a8_kernels,
                                                bf16_prompts=self.loaded.w8a8_bf16_prompts)

    @property
    def tokenizer(self):
        """The tokenizer prompts are cut with (the model's unless another was given)."""
        return self.prompt_tokenizer or self.loaded.tokenizer

    def engine(self, overrides: dict[str, Any]):
        from tandem.build import engine_for

        refuse_routing(overrides)
        scheduler = dataclasses.replace(self.base.scheduler, **overrides)
        return engine_for(dataclasses.replace(self.base, scheduler=scheduler), self.loaded)

    def utilization(self, steps) -> tuple[float, float]:
        busy = sum(s.duration for s in steps) or 1e-9
        flops = nbytes = 0.0
        for s in steps:
            f, b = self.cost.step(s.spans(), s.num_sampled)
            flops += f
            nbytes += b
        return flops / busy / self.peaks.flops_per_s, nbytes / busy / self.peaks.bytes_per_s


def evaluate(evaluator, candidate: Candidate, requests: list[BenchRequest], offsets: list[float],
             percentiles: list[float], slos: dict[str, float], max_duration: float, progress=None) -> Evaluation:
    if hasattr(evaluator, "run"):  # it measures a server of its own, not an engine here
        return evaluator.run(candidate, requests, offsets, percentiles, slos, max_duration, progress)
    engine = evaluator.engine(candidate.overrides)
    arrival = ArrivalSpec(request_rate=math.inf)
    data = run_inprocess(engine, requests, offsets, arrival, True, max_duration, progress)
    summary = summarize_run(data.results, data.duration, percentiles, ("ttft", "tpot", "itl", "e2el", "stall"), slos)
    steps = list(engine.step_stats)
    ev = Evaluation(candidate, summary, data, steps, engine.num_preemptions)
    if hasattr(engine, "routing_summary"):
        ev.replicas = engine.routing_summary()
    if hasattr(evaluator, "utilization"):
        ev.mfu, ev.mbu = evaluator.utilization(steps)
    return ev
