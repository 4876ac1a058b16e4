"""The built-in workloads of `tandem compare` and `tandem tune`, and the requests either tool
sends for a scenario name or a workload file.

This is the only list of scenarios: the CLI's choices and help come from it. It must stay free of
torch (and of anything heavy), because `tandem.bench.config` imports it to build the parser.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from tandem.bench.arrivals import arrival_offsets
from tandem.bench.prompts import BenchRequest, build_requests
from tandem.bench.workload import ArrivalSpec, LengthDist, RequestClass, Workload


@dataclass
class Scenario:
    name: str
    brief: str
    """One line for the CLI help."""
    description: str
    """What the report says the scenario is."""
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


SCENARIOS = {s.name: s for s in (
    Scenario("equal", "equal-size requests at high concurrency",
             "24 equal requests (256 prompt / 64 output tokens) arriving at once: the case where chunked "
             "prefill can raise throughput", _equal),
    Scenario("long-prompts", "long prompts arriving while chats stream",
             "12 chats (~96 prompt / 96 output tokens) streaming while 3 1536-token documents arrive 4, 10 "
             "and 16 s in: where prefill-first stalls streams", _long_prompts),
    Scenario("sharegpt-bursty", "a ShareGPT-like mix with bursty arrivals",
             "32 ShareGPT-like requests (lognormal lengths) with bursty gamma arrivals (0.8 req/s, "
             "burstiness 0.3)", _sharegpt_bursty),
)}


def scenarios_help() -> str:
    """``'name' (brief), ...`` over every scenario, for the CLI."""
    return ", ".join(f"'{s.name}' ({s.brief})" for s in SCENARIOS.values())


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
