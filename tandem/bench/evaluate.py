"""One engine configuration (a candidate) measured on a workload: a fresh engine over a shared
model, the same requests at the same times, so candidates differ only by their scheduling
settings. `tandem compare` and `tandem tune` both measure through here."""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass
from typing import Any

from tandem.bench.replay import RunData, run_inprocess
from tandem.bench.summary import summarize_run
from tandem.bench.prompts import BenchRequest
from tandem.bench.workload import ArrivalSpec
from tandem.config import EngineConfig, SchedulerConfig

# Knobs a configuration may set, with their CLI flag names.
TUNABLE = {f.name for f in dataclasses.fields(SchedulerConfig)}
_KINDS = typing.get_type_hints(SchedulerConfig)  # how each key's value is read: str, int or float


@dataclass
class Candidate:
    name: str
    overrides: dict[str, Any]

    @classmethod
    def parse(cls, text: str) -> "Candidate":
        """``"policy=chunked,max_num_batched_tokens=256"`` (an optional ``name:`` first)."""
        name, sep, rest = text.partition(":")
        if not sep or "=" in name:
            name, rest = "", text
        overrides: dict[str, Any] = {}
        for part in filter(None, (p.strip() for p in rest.split(","))):
            key, eq, value = part.partition("=")
            key = key.strip().replace("-", "_")
            if not eq or key not in TUNABLE:
                raise ValueError(f"configs: {part!r} is not KEY=VALUE with KEY in {', '.join(sorted(TUNABLE))}")
            kind = _KINDS[key] if _KINDS[key] in (str, int, float) else str
            try:
                overrides[key] = kind(value.strip())
            except ValueError:
                raise ValueError(f"configs: {part!r}: {key} takes a {kind.__name__}") from None
        SchedulerConfig(**overrides).validate()
        return cls(name or describe(overrides), overrides)


def describe(o: dict[str, Any]) -> str:
    text = o.get("policy", "chunked")
    if "max_num_batched_tokens" in o:
        text += f" chunk={o['max_num_batched_tokens']}" if text == "chunked" else f" budget={o['max_num_batched_tokens']}"
    if "max_num_seqs" in o:
        text += f" seqs={o['max_num_seqs']}"
    if o.get("fairness", "fcfs") != "fcfs":
        text += f" {o['fairness']}"
    if o.get("long_prefill_token_threshold"):
        text += f" cap={o['long_prefill_token_threshold']}x{o.get('max_long_partial_prefills', 0) or 'inf'}"
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
        self.peaks = peaks or measure_peaks(self.loaded.device.type, dtype)

    @property
    def tokenizer(self):
        """The tokenizer prompts are cut with (the model's unless another was given)."""
        return self.prompt_tokenizer or self.loaded.tokenizer

    def engine(self, overrides: dict[str, Any]):
        from tandem.build import engine_for

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
    engine = evaluator.engine(candidate.overrides)
    arrival = ArrivalSpec(request_rate=math.inf)
    data = run_inprocess(engine, requests, offsets, arrival, True, max_duration, progress)
    summary = summarize_run(data.results, data.duration, percentiles, ("ttft", "tpot", "itl", "e2el", "stall"), slos)
    steps = list(engine.step_stats)
    ev = Evaluation(candidate, summary, data, steps, engine.scheduler.num_preemptions)
    if hasattr(evaluator, "utilization"):
        ev.mfu, ev.mbu = evaluator.utilization(steps)
    return ev
