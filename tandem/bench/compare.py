"""`tandem compare`: one workload, several engine configurations, one report.

Each configuration runs on a fresh engine (the model is loaded once and shared; the KV cache,
scheduler and sampler are new) with the same seed and the same requests at the same times,
in-process, so the figures differ only by the scheduling settings; or each configuration is a
server that compare launches and stops (``tandem.bench.launched``). A scenario may bring its own
configurations (power-user: fcfs against vtc) and may be several loads asked the same question
(itl-target: one report per load, and an index).
"""

from __future__ import annotations

import time
from pathlib import Path

from tandem.bench.compare_report import write_compare_report, write_loads_index
from tandem.bench.config_keys import refuse_routing
from tandem.bench.evaluate import Candidate, InProcessEvaluator, evaluate
from tandem.bench.progress import RunProgress
from tandem.bench.repeats import merge
from tandem.bench.scenarios import DEFAULT_CONFIGS, SCENARIOS, scenario_requests
from tandem.bench.summary import parse_goodput
from tandem.bench.prompts import PlainTokenizer
from tandem.config import EngineConfig


def run_compare(scenario: str | None, workload_path: str | None, configs: list[str], base: EngineConfig,
                result_dir: str, goodput: list[str] | None = None, seed: int = 0, max_duration: float = 1800.0,
                evaluator=None, repeats: int = 1) -> dict:
    """``repeats``: runs of every configuration, round by round; the report gives medians
    (``tandem.bench.repeats``)."""
    if not isinstance(repeats, int) or isinstance(repeats, bool) or repeats < 1:
        raise ValueError(f"repeats: must be an integer >= 1, got {repeats!r}")
    scenario = scenario if workload_path or scenario else "equal"
    sc = None if workload_path else SCENARIOS.get(scenario)
    configs = list(configs or (sc.configs if sc and sc.configs else DEFAULT_CONFIGS))
    if getattr(evaluator, "candidates", None) is None:
        for c in configs:  # a typo fails before the model loads
            overrides = Candidate.parse(c).overrides
            if evaluator is None:
                refuse_routing(overrides)
    evaluator = evaluator or InProcessEvaluator(base)
    if sc and sc.loads:
        runs = {load: _compare_one(load, None, configs, base, str(Path(result_dir) / load), goodput, seed,
                                   max_duration, evaluator, repeats) for load in sc.loads}
        index = write_loads_index(Path(result_dir), sc, {k: v["evaluations"] for k, v in runs.items()},
                                  getattr(evaluator, "meta", {}).get("profile"))
        return {"evaluations": [e for r in runs.values() for e in r["evaluations"]], "loads": runs,
                "paths": [str(index)] + [p for r in runs.values() for p in r["paths"]]}
    return _compare_one(scenario, workload_path, configs, base, result_dir, goodput, seed, max_duration, evaluator,
                        repeats)


def _compare_one(scenario: str | None, workload_path: str | None, configs: list[str], base: EngineConfig,
                 result_dir: str, goodput: list[str] | None, seed: int, max_duration: float, evaluator,
                 repeats: int = 1) -> dict:
    candidates = getattr(evaluator, "candidates", None) or [Candidate.parse(c) for c in configs]
    slos = parse_goodput(goodput)
    tok = PlainTokenizer(evaluator.tokenizer)
    requests, offsets, title, description, seqs = scenario_requests(scenario, workload_path, tok, seed)
    if seqs:
        candidates = [Candidate(c.name, {"max_num_seqs": seqs, **c.overrides}) for c in candidates]
    runs: list[list] = [[] for _ in candidates]
    for i in range(repeats):  # round by round: a slow spell of the machine falls on every configuration
        for cand, done in zip(candidates, runs):
            label = cand.name if repeats == 1 else f"{cand.name} (run {i + 1}/{repeats})"
            with RunProgress(len(requests), label) as progress:
                done.append(evaluate(evaluator, cand, requests, offsets, [50, 90, 99], slos, max_duration, progress))
    evaluations = [merge(done) for done in runs]
    meta = {"scenario": title, "description": description, "seed": seed, "date": time.strftime("%Y-%m-%d %H:%M"),
            "base_config": base.flat(), "goodput_slos_ms": {k: v * 1000 for k, v in slos.items()},
            "num_requests": len(requests), "repeats": repeats}
    if getattr(evaluator, "peaks", None) is not None:
        meta["peak_flops_per_s"] = evaluator.peaks.flops_per_s
        meta["peak_bytes_per_s"] = evaluator.peaks.bytes_per_s
    meta.update(getattr(evaluator, "meta", {}))  # a simulator names its cost profile
    paths = write_compare_report(Path(result_dir), evaluations, meta)
    return {"evaluations": evaluations, "paths": [str(p) for p in paths]}
