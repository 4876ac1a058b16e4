"""The ``tandem`` command."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from tandem.cli_args import add_dataclass_args, add_engine_args, dataclass_from_args, engine_config_from_args
from tandem.config import ServerConfig
from tandem.startup import show_notices
from tandem.core.sampling_params import CLI_DEFAULTS, TARGET_FIELDS, SamplingParams


def _command(sub, name: str, help: str, description: str) -> argparse.ArgumentParser:
    return sub.add_parser(name, help=help, description=description,
                          formatter_class=argparse.ArgumentDefaultsHelpFormatter)


def _generate_parser(sub) -> None:
    p = _command(
        sub,
        "generate",
        help="generate text from one or more prompts",
        description="Generate text from prompts with the engine in this process.",
    )
    p.add_argument("--prompt", action="append", required=True, help="a prompt (repeat for a concurrent batch)")
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt with timing data")
    # The per-request seed is the engine's --seed; the latency targets are the engine's flags.
    add_dataclass_args(p, SamplingParams, "sampling options", skip=("seed", "bad_words_token_ids", "constraint", *TARGET_FIELDS),
                       defaults=CLI_DEFAULTS)
    add_engine_args(p)


def _run_generate(args: argparse.Namespace) -> int:
    from tandem.llm import LLM

    config = engine_config_from_args(args)
    params = dataclass_from_args(SamplingParams, args, seed=config.model.seed, **dict.fromkeys(TARGET_FIELDS))
    print("loading model ...", file=sys.stderr, flush=True)
    llm = LLM(**config.flat())
    print(f"paths: {llm.loaded.paths_line()}", file=sys.stderr, flush=True)
    outputs = llm.generate(args.prompt, params)
    for out in outputs:
        t = out.timing
        if args.json:
            print(json.dumps({
                "prompt": out.prompt,
                "text": out.text,
                "token_ids": out.token_ids,
                "finish_reason": out.finish_reason,
                "num_prompt_tokens": len(out.prompt_token_ids),
                "ttft_s": t.ttft,
                "e2e_s": t.e2e,
                "num_preemptions": t.num_preemptions,
                "logprobs": [
                    {"token_id": lp.token_id, "logprob": lp.logprob, "top": lp.top} for lp in out.logprobs
                ] or None,
            }))
        else:
            print(f"{out.prompt}\033[1m{out.text}\033[0m" if sys.stdout.isatty() else out.prompt + out.text)
            n = len(out.token_ids)
            rate = (n - 1) / (t.e2e - t.ttft) if n > 1 and t.e2e and t.e2e > t.ttft else float("nan")
            print(
                f"[{n} tokens, finish={out.finish_reason}, TTFT {t.ttft * 1e3:.0f} ms, "
                f"{rate:.1f} tok/s after the first]",
                file=sys.stderr,
            )
    return 0


def _serve_parser(sub) -> None:
    p = _command(
        sub,
        "serve",
        help="serve the OpenAI-compatible HTTP API",
        description="Serve /v1/completions, /v1/chat/completions, /metrics and friends over HTTP.",
    )
    add_dataclass_args(p, ServerConfig, "server options")
    add_engine_args(p)


def _run_serve(args: argparse.Namespace) -> int:
    from tandem.server.routes import create_app
    from tandem.server.serve import PortInUse, bind, serve
    from tandem.server.state import build_state

    engine_config = engine_config_from_args(args)
    server_config = dataclass_from_args(ServerConfig, args)
    server_config.validate()
    if server_config.replicas > 1 or server_config.ray_address is not None:
        from tandem.scale.app import serve_replicated
        return serve_replicated(engine_config, server_config, args.log_level.lower())
    try:
        sock = bind(server_config.host, server_config.port)  # before the model: a taken port fails at once
    except PortInUse as exc:
        print(f"tandem: error: {exc}", file=sys.stderr)
        return 1
    try:
        print("loading model ...", file=sys.stderr, flush=True)
        state = build_state(engine_config, server_config)
    except KeyboardInterrupt:
        sock.close()
        print("tandem: interrupted while loading the model", file=sys.stderr)
        return 130
    port = sock.getsockname()[1]

    def started() -> None:
        print(f"tandem serving {state.model_name!r} on http://{server_config.host}:{port} "
              f"(policy {engine_config.scheduler.policy}, {state.engine.allocator.num_blocks} KV blocks)",
              file=sys.stderr, flush=True)
        print(f"paths: {state.paths_line}", file=sys.stderr, flush=True)

    serve(create_app(state), state, sock, args.log_level.lower(), on_started=started)
    return 0


def _bench_parser(sub) -> None:
    from tandem.bench.config import BenchConfig

    p = _command(
        sub,
        "bench",
        help="load-test an OpenAI-compatible server (or the engine in-process) and report",
        description="Replay a workload against any OpenAI-compatible server (tandem, vLLM, llama.cpp's "
        "llama-server, TGI) or tandem's engine in-process; write result.json, summary.md, report.html and plots.",
    )
    add_dataclass_args(p, BenchConfig, "bench options")
    add_engine_args(p, skip=("model", "seed"))


def _run_bench(args: argparse.Namespace) -> int:
    from tandem.bench.config import BenchConfig
    from tandem.bench.main import run_bench

    cfg = dataclass_from_args(BenchConfig, args)
    engine_config = (engine_config_from_args(args, model=cfg.model, seed=cfg.seed)
                     if cfg.backend == "inprocess" else None)
    out = run_bench(cfg, engine_config)
    code = _print_report(Path(cfg.result_dir, "sweep.md" if cfg.sweep else "summary.md"), out["paths"])
    if out["failure"]:
        print(f"tandem bench: {out['failure']}", file=sys.stderr)
        return 1
    return code


def _print_report(markdown: Path, paths: list[str]) -> int:
    print(markdown.read_text())
    print("wrote: " + ", ".join(paths), file=sys.stderr)
    return 0


def _compare_parser(sub) -> None:
    from tandem.bench.config import CompareConfig, TuneConfig

    p = _command(
        sub,
        "compare",
        help="run one workload against several scheduler configurations and report side by side",
        description="Each configuration runs on a fresh engine in this process with the same requests, or on a "
        "server that compare launches (--server, --server-cmd with --engine); the report has throughput, TTFT/ITL percentiles, stalls, goodput, utilization, ITL timelines and step mix.",
    )
    add_dataclass_args(p, CompareConfig, "compare options")
    add_engine_args(p, skip=("seed",))
    t = _command(
        sub,
        "tune",
        help="search chunk size and batch limits for the highest goodput within latency SLOs",
        description="Coarse-to-fine search over max_num_batched_tokens, max_num_seqs and the long-prompt caps "
        "of the chunked policy, in this process or on servers it launches (--server-cmd, --engine); re-measures "
        "the leaders; prints the command line of the best.",
    )
    add_dataclass_args(t, TuneConfig, "tune options")
    add_engine_args(t, skip=("seed",))


def _simulate_parser(sub) -> None:
    from tandem.bench.config import CalibrateConfig, SimulateConfig
    from tandem.config import SchedulerConfig

    p = _command(
        sub,
        "simulate",
        help="run compare's workloads and report on the simulator, with a cost profile",
        description="The real scheduler on a virtual clock, each step priced by a cost profile (measured by "
        "`tandem calibrate`, or the roofline of a shipped device and model): compare's report in seconds.",
    )
    add_dataclass_args(p, SimulateConfig, "simulate options")
    add_dataclass_args(p, SchedulerConfig, "scheduler options")
    c = _command(
        sub,
        "calibrate",
        help="time a designed set of steps on the real engine and write a measured cost profile",
        description="Prompt chunks of several sizes, decode batches of several sizes and contexts, and mixed "
        "steps, each timed several times; fits the step-time model and the engine's per-step overhead.",
    )
    add_dataclass_args(c, CalibrateConfig, "calibrate options")
    add_engine_args(c)


def _run_compare(args: argparse.Namespace) -> int:
    from tandem.bench.compare import run_compare
    from tandem.bench.config import CompareConfig

    from tandem.bench.launched import from_config

    cfg = dataclass_from_args(CompareConfig, args)
    base = engine_config_from_args(args, seed=cfg.seed)
    out = run_compare(None if cfg.workload else cfg.scenario, cfg.workload, list(cfg.configs), base,
                      cfg.result_dir, list(cfg.goodput), cfg.seed, cfg.max_duration, evaluator=from_config(cfg, base),
                      repeats=cfg.repeats)
    return _print_report(Path(cfg.result_dir, "compare.md"), out["paths"])


def _run_simulate(args: argparse.Namespace) -> int:
    from tandem.bench.config import SimulateConfig
    from tandem.bench.simulate import run_simulate
    from tandem.config import SchedulerConfig

    cfg = dataclass_from_args(SimulateConfig, args)
    scheduler = dataclass_from_args(SchedulerConfig, args)
    scheduler.validate()
    out = run_simulate(cfg, scheduler)
    return _print_report(Path(cfg.result_dir, "compare.md"), out["paths"])


def _run_calibrate(args: argparse.Namespace) -> int:
    from tandem.bench.calibrate import run_calibrate
    from tandem.bench.config import CalibrateConfig

    cfg = dataclass_from_args(CalibrateConfig, args)
    profile = run_calibrate(cfg, engine_config_from_args(args))
    if cfg.rescale:
        check = profile["speed_check"]
        steps = ", ".join(f"{k} {v['calibrated']:.1f} -> {v['now']:.1f} ms" for k, v in check["steps_ms"].items())
        print(f"wrote {cfg.output}: {cfg.rescale} scaled x{check['ratio']:.3f} to this machine's speed now "
              f"(prompt terms x{check['prefill_ratio']:.3f}, the rest x{check['decode_ratio']:.3f}; {steps})")
        return 0
    fit = profile["fit"]
    print(f"wrote {cfg.output}: forward {profile['forward']}, overhead {profile['overhead']}; fit over "
          f"{fit['steps']} steps, median |error| {100 * fit['median_abs_error']:.1f}%, "
          f"worst {100 * fit['max_abs_error']:.1f}%")
    if fit["median_abs_error"] > 0.2:
        print("tandem calibrate: warning: the step-time model fits the timed steps poorly; a busy machine "
              "(or nice) makes step times jump, so calibrate on a quiet one", file=sys.stderr)
    return 0


def _run_tune(args: argparse.Namespace) -> int:
    from tandem.bench.config import TuneConfig
    from tandem.bench.tune_run import run_tune

    cfg = dataclass_from_args(TuneConfig, args)
    base = engine_config_from_args(args, seed=cfg.seed)
    out = run_tune(cfg, base)
    return _print_report(Path(cfg.result_dir, "tune.md"), out["paths"])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description="tandem inference engine")
    parser.add_argument("--log-level", default="WARNING", help="logging level")
    sub = parser.add_subparsers(dest="command", required=True)
    _generate_parser(sub)
    _serve_parser(sub)
    _bench_parser(sub)
    _compare_parser(sub)
    _simulate_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    show_notices()  # a first start's one-time work, shown at the default level
    try:
        if args.command == "generate":
            return _run_generate(args)
        if args.command == "serve":
            return _run_serve(args)
        if args.command == "bench":
            return _run_bench(args)
        if args.command == "compare":
            return _run_compare(args)
        if args.command == "tune":
            return _run_tune(args)
        if args.command == "simulate":
            return _run_simulate(args)
        if args.command == "calibrate":
            return _run_calibrate(args)
    except ValueError as exc:
        print(f"tandem: error: {exc}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
