"""Glue for `tandem tune`: measure candidates against a scenario, on the in-process engine or on
servers launched per trial (``--server-cmd``, with an ``--engine`` preset: then only that engine's
knobs are searched)."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from tandem.bench.config import TuneConfig
from tandem.bench.config_keys import parse_overrides
from tandem.bench.evaluate import Candidate, InProcessEvaluator, evaluate
from tandem.bench.scenarios import scenario_requests
from tandem.bench.summary import parse_goodput
from tandem.bench.tune import SLO, TuneResult, tune, tune_over
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
    """``evaluator``: what measures on the real engine (default: in-process over ``base``'s model);
    with ``cfg.simulate`` the search runs on the simulator and only the confirmation on it."""
    slo = SLO(cfg.slo_ttft_ms, cfg.slo_itl_ms)
    slo.validate()
    chunks, seqs = cfg.grid("chunk_sizes"), cfg.grid("max_num_seqs_values")
    fixed = parse_overrides(cfg.fixed)
    console = Console(stderr=True)
    targets = cfg.targets()
    if cfg.confirm < 0:
        raise ValueError(f"confirm: must be >= 0, got {cfg.confirm}")
    profile = None
    render = None
    try_long_caps = True
    launched = evaluator or _launched(cfg, base)
    if getattr(launched, "run", None) is not None:
        evaluator = launched
        chunks, seqs, targets, try_long_caps = _search_space(launched, chunks, seqs, targets, console)
        render = launched.command_line
        # a knob the engine lacks, in --fixed, fails here rather than at the first server start
        render({"policy": "chunked", **fixed, "max_num_batched_tokens": chunks[0], "max_num_seqs": seqs[0]})
    deployments = cfg.deployments()
    if deployments != [{}] and render is None and not cfg.simulate:
        raise ValueError("replicas_values: replicas are tuned on a launched tandem server (--server-cmd with "
                         "--engine tandem) or in the simulator (--simulate); the in-process engine is one replica")
    if cfg.simulate:
        from tandem.bench.simulate import SimEvaluator
        from tandem.sim.profile import describe, load_profile

        profile = load_profile(cfg.simulate)
        search = SimEvaluator(profile, base.scheduler)
    else:
        search = evaluator = evaluator or InProcessEvaluator(base)
    scenario = None if cfg.workload else cfg.scenario
    slos = parse_goodput(slo.goodput_args())

    def measurer(ev):
        requests, offsets, title, description, _ = scenario_requests(
            scenario, cfg.workload, PlainTokenizer(ev.tokenizer), cfg.seed)

        def measure(overrides: dict) -> dict:
            return evaluate(ev, Candidate("trial", overrides), requests, offsets, [50, 99], slos,
                            cfg.max_duration).summary
        return measure, (title, description, len(requests))

    measure, (title, description, num_requests) = measurer(search)

    def tune_one(deployment: dict) -> TuneResult:
        # the simulator gives the same answer every time: measuring a leader again adds nothing
        return tune(measure, slo, chunks, seqs, repeats=1 if profile else cfg.repeats,
                    max_trials=max(1, cfg.max_trials // len(deployments)), try_long_caps=try_long_caps,
                    base_command=serve_base(base), log=lambda line: console.print(line), targets=targets,
                    fixed={**fixed, **deployment}, render=render)

    result = tune_over(deployments, tune_one, slo, render, serve_base(base))
    meta = {"workload": title, "description": description, "num_requests": num_requests, "seed": cfg.seed}
    if render is not None:
        meta.update(evaluator.meta, server_cmd=cfg.server_cmd)
    if profile:
        meta["simulated"] = describe(profile)
    paths = write_tune_report(Path(cfg.result_dir), result, slo, meta)
    out: dict = {"result": result}
    if profile and cfg.confirm:
        from tandem.bench.tune_confirm import confirm, write_confirm

        real_measure, _ = measurer(evaluator or InProcessEvaluator(base))
        out["confirmed"] = confirm(result, slo, real_measure, cfg.confirm, render or serve_base(base),
                                   log=lambda line: console.print(line))
        paths += write_confirm(Path(cfg.result_dir), out["confirmed"], describe(profile))
    out["paths"] = [str(p) for p in paths]
    return out


def _launched(cfg: TuneConfig, base: EngineConfig):
    from tandem.bench.launched import from_config

    return from_config(cfg, base)


def _search_space(launched, chunks, seqs, targets, console):
    """Only the knobs the server can be given: a preset's, or the command's placeholders; a knob
    it lacks keeps one value (and is not set on the server)."""
    from tandem.bench.presets import tunable

    knobs = tunable(launched.command, launched.preset)
    if not knobs & {"max_num_batched_tokens", "max_num_seqs"}:
        raise ValueError("server_cmd: nothing to tune: give --engine, or put {max_num_batched_tokens} and/or "
                         "{max_num_seqs} in the command")
    if "max_num_batched_tokens" not in knobs:
        chunks = chunks[-1:]
    if "max_num_seqs" not in knobs:
        seqs = seqs[-1:]
    if "target_itl_ms" not in knobs:
        targets = []
    caps = {"long_prefill_token_threshold", "max_long_partial_prefills"} <= knobs
    console.print(f"tuning a launched server ({launched.meta['engine']}): "
                  + ", ".join(k for k in ("max_num_batched_tokens", "max_num_seqs") if k in knobs)
                  + (", long-prefill caps" if caps else "") + (", ITL targets" if targets else ""))
    return chunks, seqs, targets, caps
