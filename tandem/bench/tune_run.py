"""Glue for `tandem tune`: measure candidates on the in-process engine against a scenario."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from tandem.bench.config import TuneConfig
from tandem.bench.config_keys import parse_overrides
from tandem.bench.evaluate import Candidate, InProcessEvaluator, evaluate
from tandem.bench.scenarios import scenario_requests
from tandem.bench.summary import parse_goodput
from tandem.bench.tune import SLO, tune
from tandem.bench.tune_report import write_tune_report
from tandem.bench.prompts import PlainTokenizer
from tandem.config import EngineConfig


def serve_base(base: EngineConfig) -> str:
    parts = ["tandem serve"]
    if base.model.model:
        parts.append(f"--model {base.model.model}")
    if base.model.dtype != "auto":
        parts.append(f"--dtype {base.model.dtype}")
    return " ".join(parts)


def run_tune(cfg: TuneConfig, base: EngineConfig, evaluator=None) -> dict:
    slo = SLO(cfg.slo_ttft_ms, cfg.slo_itl_ms)
    slo.validate()
    chunks, seqs = cfg.grid("chunk_sizes"), cfg.grid("max_num_seqs_values")
    fixed = parse_overrides(cfg.fixed)
    console = Console(stderr=True)
    targets = cfg.targets()
    evaluator = evaluator or InProcessEvaluator(base)
    requests, offsets, title, description, _ = scenario_requests(
        None if cfg.workload else cfg.scenario, cfg.workload, PlainTokenizer(evaluator.tokenizer), cfg.seed)
    slos = parse_goodput(slo.goodput_args())

    def measure(overrides: dict) -> dict:
        ev = evaluate(evaluator, Candidate("trial", overrides), requests, offsets, [50, 99], slos, cfg.max_duration)
        return ev.summary

    result = tune(measure, slo, chunks, seqs, repeats=cfg.repeats, max_trials=cfg.max_trials,
                  base_command=serve_base(base), log=lambda line: console.print(line), targets=targets, fixed=fixed)
    meta = {"workload": title, "description": description, "num_requests": len(requests), "seed": cfg.seed}
    paths = write_tune_report(Path(cfg.result_dir), result, slo, meta)
    return {"result": result, "paths": [str(p) for p in paths]}
