"""`tandem compare`: one workload, several engine configurations, one report.

Each configuration runs on a fresh engine (the model is loaded once and shared; the KV cache,
scheduler and sampler are new) with the same seed and the same requests at the same times,
in-process, so the figures differ only by the scheduling settings.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from tandem.bench.arrivals import arrival_offsets
from tandem.bench.progress import RunProgress
from tandem.bench.replay import RunData, run_inprocess
from tandem.bench.summary import parse_goodput, summarize_run
from tandem.bench.workload import (
    ArrivalSpec,
    BenchRequest,
    LengthDist,
    PlainTokenizer,
    RequestClass,
    Workload,
    build_requests,
)
from tandem.config import EngineConfig, SchedulerConfig

# Knobs a configuration may set, with their CLI flag names.
TUNABLE = {f.name for f in dataclasses.fields(SchedulerConfig)}


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
            overrides[key] = value.strip() if key == "policy" else int(value)
        SchedulerConfig(**overrides).validate()
        return cls(name or describe(overrides), overrides)


def describe(o: dict[str, Any]) -> str:
    text = o.get("policy", "chunked")
    if "max_num_batched_tokens" in o:
        text += f" chunk={o['max_num_batched_tokens']}" if text == "chunked" else f" budget={o['max_num_batched_tokens']}"
    if "max_num_seqs" in o:
        text += f" seqs={o['max_num_seqs']}"
    if o.get("long_prefill_token_threshold"):
        text += f" cap={o['long_prefill_token_threshold']}x{o.get('max_long_partial_prefills', 0) or 'inf'}"
    return text


# prefill-first gets a large budget (vLLM without chunking uses at least 2048 tokens per step)
DEFAULT_CONFIGS = [
    "policy=static",
    "policy=prefill-first,max_num_batched_tokens=2048",
    "policy=chunked,max_num_batched_tokens=128",
    "policy=chunked,max_num_batched_tokens=512",
]


@dataclass
class Scenario:
    name: str
    description: str
    build: Callable[[Any, int], tuple[list[BenchRequest], list[float]]]
    max_num_seqs: int = 32


def _equal(tok, seed: int):
    w = Workload(dataset="random", num_prompts=24, seed=seed,
                 classes=[RequestClass("equal", 1.0, LengthDist("fixed", 256), LengthDist("fixed", 64))])
    reqs = build_requests(w, tok)
    return reqs, [0.0] * len(reqs)


def _long_prompts(tok, seed: int):
    chat = Workload(dataset="random", num_prompts=12, seed=seed, classes=[
        RequestClass("chat", 1.0, LengthDist("lognormal", 96, sigma=0.3, max=192), LengthDist("fixed", 96))])
    docs = Workload(dataset="random", num_prompts=3, seed=seed + 1, classes=[
        RequestClass("document", 1.0, LengthDist("fixed", 1536), LengthDist("fixed", 16))])
    reqs = build_requests(chat, tok) + build_requests(docs, tok)
    for i, r in enumerate(reqs):
        r.index = i
    # the chats start together and stream; the documents land in the middle of their streams
    offsets = [0.2 * i for i in range(12)] + [4.0 + 6.0 * i for i in range(3)]
    return reqs, offsets


def _sharegpt_bursty(tok, seed: int):
    w = Workload(dataset="random", num_prompts=32, seed=seed, classes=[
        # lognormal fits of ShareGPT first turns and answers, shortened for a 2-core CPU
        RequestClass("sharegpt-like", 1.0, LengthDist("lognormal", 180, sigma=0.8, max=1024),
                     LengthDist("lognormal", 80, sigma=0.6, max=200)),
    ], arrival=ArrivalSpec("gamma", request_rate=0.8, burstiness=0.3))
    reqs = build_requests(w, tok)
    return reqs, arrival_offsets(w.arrival, len(reqs), seed)


SCENARIOS = {
    "equal": Scenario("equal", "24 equal requests (256 prompt / 64 output tokens) arriving at once: the case "
                      "where chunked prefill can raise throughput", _equal),
    "long-prompts": Scenario("long-prompts", "12 chats (~96 prompt / 96 output tokens) streaming while 3 "
                             "1536-token documents arrive 4, 10 and 16 s in: where prefill-first stalls "
                             "streams", _long_prompts),
    "sharegpt-bursty": Scenario("sharegpt-bursty", "32 ShareGPT-like requests (lognormal lengths) with bursty "
                                "gamma arrivals (0.8 req/s, burstiness 0.3)", _sharegpt_bursty),
}


@dataclass
class Evaluation:
    candidate: Candidate
    summary: dict
    data: RunData
    steps: list
    preemptions: int
    mfu: float | None = None
    mbu: float | None = None
    extra: dict = field(default_factory=dict)


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


def run_compare(scenario: str | None, workload_path: str | None, configs: list[str], base: EngineConfig,
                result_dir: str, goodput: list[str] | None = None, seed: int = 0, max_duration: float = 1800.0,
                evaluator=None) -> dict:
    candidates = [Candidate.parse(c) for c in (configs or DEFAULT_CONFIGS)]
    scenario = scenario if workload_path or scenario else "equal"
    slos = parse_goodput(goodput)
    evaluator = evaluator or InProcessEvaluator(base)
    tok = PlainTokenizer(evaluator.tokenizer)
    requests, offsets, title, description, seqs = scenario_requests(scenario, workload_path, tok, seed)
    if seqs:
        candidates = [Candidate(c.name, {"max_num_seqs": seqs, **c.overrides}) for c in candidates]
    evaluations = []
    for cand in candidates:
        with RunProgress(len(requests), cand.name) as progress:
            evaluations.append(evaluate(evaluator, cand, requests, offsets, [50, 90, 99], slos, max_duration,
                                        progress))
    from tandem.bench.compare_report import write_compare_report

    meta = {"scenario": title, "description": description, "seed": seed, "date": time.strftime("%Y-%m-%d %H:%M"),
            "base_config": base.flat(), "goodput_slos_ms": {k: v * 1000 for k, v in slos.items()},
            "num_requests": len(requests)}
    if getattr(evaluator, "peaks", None) is not None:
        meta["peak_flops_per_s"] = evaluator.peaks.flops_per_s
        meta["peak_bytes_per_s"] = evaluator.peaks.bytes_per_s
    paths = write_compare_report(Path(result_dir), evaluations, meta)
    return {"evaluations": evaluations, "paths": [str(p) for p in paths]}


def scenario_requests(scenario: str | None, workload_path: str | None, tok, seed: int):
    """-> (requests, send offsets, title, description, max_num_seqs of the scenario or None)."""
    if workload_path:
        w = Workload.load(workload_path)
        requests = build_requests(w, tok)
        offsets = ([r.arrival_s or 0.0 for r in requests] if w.dataset == "trace"
                   else arrival_offsets(w.arrival, len(requests), w.seed))
        return requests, offsets, Path(workload_path).stem, f"workload file {workload_path}", None
    if scenario not in SCENARIOS:
        raise ValueError(f"scenario: must be one of {', '.join(SCENARIOS)}, got {scenario!r}")
    sc = SCENARIOS[scenario]
    requests, offsets = sc.build(tok, seed)
    return requests, offsets, sc.name, sc.description, sc.max_num_seqs


def row(ev: Evaluation) -> dict:
    s = ev.summary
    return {
        "config": ev.candidate.name, **ev.candidate.overrides,
        "completed": s["completed"], "failed": s["failed"],
        "output_throughput": s["output_throughput"], "total_token_throughput": s["total_token_throughput"],
        "median_ttft_ms": s["median_ttft_ms"], "p99_ttft_ms": s["p99_ttft_ms"],
        "median_itl_ms": s["median_itl_ms"], "p99_itl_ms": s["p99_itl_ms"],
        "p99_stall_ms": s["p99_stall_ms"], "request_goodput": s.get("request_goodput"),
        "mfu": ev.mfu, "mbu": ev.mbu, "preemptions": ev.preemptions,
        "steps": len(ev.steps),
    }


def results_json(evaluations: list[Evaluation], meta: dict) -> str:
    return json.dumps({**meta, "configs": [row(e) for e in evaluations]}, indent=1, default=str)

