"""Starting, warming up and stopping the peers of benchmarks/peers.py, and running the measured
levels on each: tandem's and llama.cpp's servers over HTTP, llama-bench as a subprocess, the
transformers peers in this process (peer_transformers). Each peer fills in a PeerResult.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import json
import math
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

from tandem.bench.launch import ServerProcess, free_port
from tandem.bench.progress import RunProgress
from tandem.bench.replay import RunData, run_openai
from tandem.bench.summary import sizing_summary, summarize_run

if TYPE_CHECKING:
    from peers import Level, Plan

ROOT = Path(__file__).resolve().parent.parent
PERCENTILES = (50, 99)
STARTUP_TIMEOUT_S = 900


# --- a peer's outcome ----------------------------------------------------------------------------

@dataclass
class PeerResult:
    peer: str
    status: str = "ok"  # ok | skipped | failed
    reason: str = ""
    command: str = ""
    info: dict = field(default_factory=dict)
    levels: list[dict] = field(default_factory=list)


def level_row(level: Level, data: RunData) -> dict:
    summary = {**summarize_run(data.results, data.duration, PERCENTILES), **sizing_summary(data.samples)}
    ok = [r for r in data.results if r.success and r.prompt_tokens is not None]
    return {
        "concurrency": level.concurrency,
        "num_requests": len(level.requests),
        "mean_prompt_tokens": sum(r.prompt_tokens for r in ok) / len(ok) if ok else None,
        "summary": summary,
        "notes": data.notes,
    }


def run_level(label: str, level: Level, runner) -> dict:
    """Run one level with a progress bar (or lines), print its headline and return its row."""
    print(f"  {label}: concurrency {level.concurrency}, {len(level.requests)} requests", flush=True)
    with RunProgress(len(level.requests), f"{label} c={level.concurrency}") as progress:
        data = runner(level, progress)
    row = level_row(level, data)
    s = row["summary"]
    print(f"  {label} c={level.concurrency}: {s['completed']}/{len(level.requests)} ok, "
          f"{s['output_throughput']:.2f} output tok/s, TTFT p50 {s['median_ttft_ms']:.0f} ms, "
          f"ITL p50 {s['median_itl_ms']:.0f} ms", flush=True)
    return row


# --- HTTP peers (tandem, llama-server) -----------------------------------------------------------



@contextlib.contextmanager
def served(cmd: list[str], url: str, log_path: Path):
    """Start a server, wait for /health to answer 200, stop it afterwards."""
    server = ServerProcess(cmd, url, startup_timeout=STARTUP_TIMEOUT_S, log_path=log_path)
    try:
        yield server.proc
    finally:
        server.stop(timeout=30, sig=signal.SIGTERM)


def server_info(url: str, paths: tuple[str, ...]) -> dict:
    info = {}
    for path in paths:
        with contextlib.suppress(httpx.HTTPError, ValueError):
            r = httpx.get(url + path, timeout=5)
            if r.status_code == 200:
                info[path] = r.json()
    return info


def served_model(info: dict) -> str | None:
    data = (info.get("/v1/models") or {}).get("data") or []
    return data[0].get("id") if data else None


def warm_up(url: str, model: str | None, level: Level) -> None:
    req = level.requests[0]
    body = {"prompt": req.prompt, "max_tokens": req.output_len, "temperature": 0.0, "ignore_eos": True}
    if model:
        body["model"] = model
    httpx.post(url + "/v1/completions", json=body, timeout=600).raise_for_status()


def run_http_peer(res: PeerResult, cmd: list[str], url: str, plan: Plan, args, info_paths) -> None:
    res.command = shlex.join(cmd).replace(str(ROOT) + "/", "")
    print(f"  starting: {res.command}", flush=True)
    with tempfile.TemporaryDirectory() as tmp, served(cmd, url, Path(tmp) / "server.log"):
        res.info.update(server_info(url, info_paths))
        model = served_model(res.info)
        warm_up(url, model, plan.warm_up)

        def runner(level: Level, progress) -> RunData:
            return asyncio.run(run_openai(level.requests, [0.0] * len(level.requests), level.arrival, url,
                                          "/v1/completions", model, True, {}, args.timeout, args.timeout, 1.0,
                                          progress))

        res.levels = [run_level(res.peer, level, runner) for level in plan.levels]


def tandem_cli() -> list[str]:
    """The `tandem` entry point of this interpreter's environment (.venv/bin/tandem)."""
    exe = Path(sys.executable).parent / "tandem"
    return [str(exe)] if exe.is_file() else [sys.executable, "-m", "tandem.cli"]


def run_tandem(res: PeerResult, plan: Plan, args) -> None:
    port = free_port()
    cmd = [*tandem_cli(), "serve", "--port", str(port), "--model", args.model,
           "--threads", str(args.threads), "--max-num-seqs", str(max(args.concurrency)),
           *shlex.split(args.tandem_args)]
    run_http_peer(res, cmd, f"http://127.0.0.1:{port}", plan, args, ("/v1/models", "/version", "/config"))


def run_llama_server(res: PeerResult, plan: Plan, args) -> None:
    slots = max(args.concurrency)
    port = free_port()
    cmd = [args.llama_server, "-m", args.model, "--host", "127.0.0.1", "--port", str(port), "-np", str(slots),
           "-c", str(slots * (args.input_len + args.output_len + 64)), "-t", str(args.threads), "--metrics"]
    res.info["version"] = binary_version(args.llama_server)
    run_http_peer(res, cmd, f"http://127.0.0.1:{port}", plan, args, ("/v1/models", "/props"))


def binary_version(path: str) -> str:
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        p = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30)
        lines = [ln for ln in (p.stdout + p.stderr).splitlines() if ln.startswith("version")]
        return lines[0] if lines else (p.stdout + p.stderr).strip()[-200:]
    return "unknown"


# --- llama-bench ---------------------------------------------------------------------------------

def run_llama_bench(res: PeerResult, plan: Plan, args) -> None:
    """pp (prompt processing) and tg (generation) at batch 1. The row's numbers are derived: TTFT ~
    input_len / pp, ITL ~ 1 / tg (a mean, no percentiles), output tok/s = what one request at a
    time would deliver: output_len / (input_len / pp + output_len / tg)."""
    cmd = [args.llama_bench, "-m", args.model, "-p", str(args.input_len), "-n", str(args.output_len),
           "-t", str(args.threads), "-r", str(args.llama_bench_reps), "-o", "json"]
    res.command = shlex.join(cmd)
    res.info["version"] = binary_version(args.llama_bench)
    print(f"  running: {res.command}", flush=True)
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    if p.returncode != 0:
        raise RuntimeError(f"llama-bench exited {p.returncode}: {p.stderr[-2000:]}")
    tests = json.loads(p.stdout)
    pp = next(t for t in tests if t["n_prompt"] > 0 and t["n_gen"] == 0)
    tg = next(t for t in tests if t["n_gen"] > 0 and t["n_prompt"] == 0)
    res.info["tests"] = [{k: t.get(k) for k in ("n_prompt", "n_gen", "n_threads", "avg_ts", "stddev_ts", "cpu_info",
                                                "backends", "build_commit", "type_k")} for t in tests]
    ttft = args.input_len / pp["avg_ts"]
    itl = 1.0 / tg["avg_ts"]
    summary = {"output_throughput": args.output_len / (ttft + args.output_len * itl),
               "median_ttft_ms": 1000 * ttft, "p99_ttft_ms": math.nan,
               "mean_itl_ms": 1000 * itl, "median_itl_ms": math.nan, "p99_itl_ms": math.nan,
               "prefill_tok_s": pp["avg_ts"], "decode_tok_s": tg["avg_ts"]}
    res.levels = [{"concurrency": 1, "num_requests": None, "derived": True, "summary": summary, "notes": []}]
    print(f"  llama-bench: pp{args.input_len} {pp['avg_ts']:.1f} tok/s, tg{args.output_len} {tg['avg_ts']:.1f} tok/s",
          flush=True)


# --- transformers --------------------------------------------------------------------------------

def run_transformers_static(res: PeerResult, plan: Plan, args) -> None:
    import peer_transformers as pt

    res.command = f"in-process: AutoModelForCausalLM.from_pretrained(gguf_file=...), {pt.DTYPE}, generate()"
    model = pt.load_model(args.model, args.threads)
    res.info.update(transformers_info(model))
    pt.run_static(model, plan.warm_up.requests, plan.warm_up.prompt_ids, 1)
    res.levels = [run_level(res.peer, level,
                            lambda lv, progress: pt.run_static(model, lv.requests, lv.prompt_ids, lv.concurrency,
                                                               progress))
                  for level in plan.levels]


def run_transformers_cb(res: PeerResult, plan: Plan, args) -> None:
    import peer_transformers as pt

    model = pt.load_model(args.model, args.threads)
    res.info.update(transformers_info(model))
    max_len = max(len(p) for lv in (*plan.levels, plan.warm_up) for p in lv.prompt_ids) + args.output_len
    res.command = (f"in-process: model.init_continuous_batching(max_requests_per_batch={max(args.concurrency)}, "
                   f"max_batch_tokens={args.cb_max_batch_tokens}), add_request(record_timestamps=True)")
    manager = pt.cb_manager(model, max(args.concurrency), max_len, args.cb_max_batch_tokens)
    try:
        res.info["cb_config"] = str(manager.continuous_batching_config)
        res.info["attn_implementation"] = model.config._attn_implementation
        pt.run_cb(manager, plan.warm_up.requests, plan.warm_up.prompt_ids, 1)
        res.levels = [run_level(res.peer, level,
                                lambda lv, progress: pt.run_cb(manager, lv.requests, lv.prompt_ids, lv.concurrency,
                                                               progress, args.timeout))
                      for level in plan.levels]
    finally:
        pt.stop_manager(manager)


def transformers_info(model) -> dict:
    import transformers

    return {"transformers": transformers.__version__, "dtype": str(model.dtype).replace("torch.", ""),
            "attn_implementation": model.config._attn_implementation}


# --- any peer ------------------------------------------------------------------------------------

RUNNERS = {
    "tandem": run_tandem,
    "llama-server": run_llama_server,
    "llama-bench": run_llama_bench,
    "transformers-static": run_transformers_static,
    "transformers-cb": run_transformers_cb,
}
PEERS = tuple(RUNNERS)  # the order they run in by default


def missing_binary(peer: str, args) -> str | None:
    """Why a llama.cpp peer cannot run (its binary is missing), or None; resolves the path."""
    attr = {"llama-server": "llama_server", "llama-bench": "llama_bench"}.get(peer)
    if attr is None:
        return None
    found = shutil.which(getattr(args, attr) or peer)
    if found:
        setattr(args, attr, found)
        return None
    flag = "--" + attr.replace("_", "-")
    given = getattr(args, attr)
    return f"{given} is not an executable" if given else f"{peer} not found on PATH; pass {flag} PATH"


def run_peer(peer: str, plan: Plan, args) -> PeerResult:
    res = PeerResult(peer, info={"load_avg_1m_before": os.getloadavg()[0]})
    why = missing_binary(peer, args)
    if why:
        res.status, res.reason = "skipped", why
        print(f"SKIP {peer}: {why}", flush=True)
        return res
    try:
        RUNNERS[peer](res, plan, args)
    except Exception as exc:
        traceback.print_exc()
        res.status, res.reason = "failed", f"{type(exc).__name__}: {exc}"[:2000]
        print(f"FAILED {peer}: {res.reason.splitlines()[0]}", flush=True)
    return res

