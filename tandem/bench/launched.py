"""The evaluator of launched servers: each trial starts a server command (vLLM, SGLang,
llama-server, tandem serve, anything OpenAI-compatible), waits until it is ready, warms it up, runs
the same requests at the same send times as every other trial through bench's HTTP runner (which
scrapes /metrics), and stops it. The log of every trial is kept; a server that cannot start, dies
or hangs makes a failed trial (its error and log tail in the report), never an exception out of
compare or tune, and never a process left running."""

from __future__ import annotations

import asyncio
import math
import signal
from pathlib import Path

import httpx

from tandem.bench.evaluate import Candidate, Evaluation
from tandem.bench.launch import LOG_TAIL_LINES, ServerProcess, free_port
from tandem.bench.presets import PRESETS, Preset, check_command, command_line, placeholders, render, slug
from tandem.bench.replay import RunData, run_openai
from tandem.bench.summary import summarize_run
from tandem.bench.client import RequestResult
from tandem.bench.workload import ArrivalSpec

HOST = "127.0.0.1"
SHOWN_PORT = 8000  # the port in a recommended command line
WARMUP = {"prompt": "Hello", "max_tokens": 4, "temperature": 0.0}


class LaunchedEvaluator:
    """``command``: the template every candidate renders (tune, or compare with ``--configs``);
    ``servers``: name -> a full command, one configuration each (compare's ``--server``)."""

    def __init__(self, result_dir: str | Path, tokenizer, command: str | None = None,
                 servers: dict[str, str] | None = None, engine: str | None = None, model: str | None = None,
                 startup_timeout: float = 600.0, stop_timeout: float = 30.0) -> None:
        if not command and not servers:
            raise ValueError("server_cmd: give a server command (or compare's --server NAME=COMMAND)")
        if engine is not None and engine not in PRESETS:
            raise ValueError(f"engine: must be one of {', '.join(PRESETS)}, got {engine!r}")
        if startup_timeout <= 0 or stop_timeout <= 0:
            raise ValueError("startup_timeout, stop_timeout: must be > 0")
        self.preset: Preset | None = PRESETS[engine] if engine else None
        self.command, self.servers = command, dict(servers or {})
        for cmd in ([command] if command else []) + list(self.servers.values()):
            check_command(cmd, self.preset)
        self.tokenizer = tokenizer
        self.model = model
        self.log_dir = Path(result_dir) / "logs"
        self.startup_timeout, self.stop_timeout = startup_timeout, stop_timeout
        self.trials = 0
        self.meta = {"launched": True, "engine": engine or "command",
                     "engine_checked": self.preset.checked if self.preset else None,
                     "engine_metrics": self.preset.metrics if self.preset else None}

    @property
    def candidates(self) -> list[Candidate] | None:
        """Compare's configurations when they are whole commands."""
        return [Candidate(name, {}) for name in self.servers] if self.servers else None

    def argv(self, candidate: Candidate, port: int) -> list[str]:
        template = self.servers.get(candidate.name) or self.command
        if template is None:
            raise ValueError(f"server: no command for configuration {candidate.name!r}")
        return render(template, candidate.overrides, port, self.model, self.preset)

    def command_line(self, overrides: dict, name: str = "") -> str:
        """The command to run a configuration outside the tuner."""
        return command_line(self.argv(Candidate(name, overrides), SHOWN_PORT))

    def run(self, candidate: Candidate, requests, offsets, percentiles, slos, max_duration, progress=None) -> Evaluation:
        self.trials += 1
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"{self.trials:02d}-{slug(candidate.name)}.log"
        port = free_port(HOST)
        argv = self.argv(candidate, port)  # a bad knob is the caller's error, before anything starts
        info = {"command": command_line(argv), "log": str(log_path), "error": None, "log_tail": None}
        if self.preset is None:  # a whole command sets only the knobs it has placeholders for
            template = self.servers.get(candidate.name) or self.command
            unset = sorted(set(candidate.overrides) - placeholders(template) - {"policy"})
            if unset:
                info["not_applied"] = unset
        data, server = None, None
        try:
            server = ServerProcess(argv, f"http://{HOST}:{port}", startup_timeout=self.startup_timeout,
                                   log_path=log_path, fallback_path="/v1/models")
            model = _served_model(server.url)
            _warm_up(server.url, model, min(self.startup_timeout, max_duration))
            data = asyncio.run(run_openai(requests, offsets, ArrivalSpec(request_rate=math.inf), server.url,
                                          "/v1/completions", model, True, {}, max_duration, max_duration, 0.5,
                                          progress))
            if server.proc.poll() is not None:
                info["error"] = f"the server exited ({server.proc.returncode}) during the run"
        except (RuntimeError, OSError, httpx.HTTPError) as exc:
            info["error"] = str(exc).splitlines()[0].rstrip(":") if str(exc) else type(exc).__name__
        finally:
            if server is not None:
                info["pgid"] = server.pgid
                code, seconds = server.stop(self.stop_timeout, signal.SIGTERM)
                info["exit"], info["stop_seconds"] = code, round(seconds, 2)
                if server.alive():
                    info["error"] = info["error"] or "processes of the server outlived SIGKILL"
        if info["error"]:
            info["log_tail"] = _tail(log_path)
        if data is None:
            failed = [RequestResult.of(r, math.nan, error=f"server failed: {info['error']}") for r in requests]
            data = RunData(failed, 0.0, notes=[info["error"]])
        summary = summarize_run(data.results, data.duration, percentiles, ("ttft", "tpot", "itl", "e2el", "stall"),
                                slos)
        summary["server_error"] = info["error"]
        summary["server_log"] = info["log"]
        summary["server_log_tail"] = info["log_tail"]
        return Evaluation(candidate, summary, data, [], None, server=info)


def _served_model(url: str) -> str | None:
    try:
        r = httpx.get(url + "/v1/models", timeout=10)
        data = r.json().get("data") if r.status_code == 200 else None
        return data[0]["id"] if data else None
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError, AttributeError):
        return None


def _warm_up(url: str, model: str | None, timeout: float) -> None:
    """One short completion before the measured run: the first request of a fresh server pays for
    lazy set-up (kernels, graphs, allocations) that no trial should be charged for."""
    body = {**WARMUP, **({"model": model} if model else {})}
    r = httpx.post(url + "/v1/completions", json=body, timeout=timeout)
    if r.status_code != 200:
        raise RuntimeError(f"warm-up request answered {r.status_code}: {r.text[:200]}")


def _tail(path: Path) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(lines[-LOG_TAIL_LINES:]) or "(empty log)"


def from_config(cfg, base, tokenizer_path: str | None = None) -> LaunchedEvaluator | None:
    """The launched evaluator a CompareConfig or TuneConfig asks for; None for in-process runs."""
    servers = _parse_servers(getattr(cfg, "server", ()) or ())
    if not servers and not cfg.server_cmd:
        if cfg.engine:
            raise ValueError("engine: needs --server-cmd (the base command the preset adds flags to)")
        return None
    if servers and getattr(cfg, "configs", ()):
        raise ValueError("configs: not with --server (each --server is a configuration; use --server-cmd and "
                         "--engine to run --configs on launched servers)")
    if servers and cfg.server_cmd:
        raise ValueError("server: give either --server NAME=COMMAND (whole commands) or --server-cmd with "
                         "--configs, not both")
    model = base.model.model
    return LaunchedEvaluator(cfg.result_dir, _tokenizer(tokenizer_path or cfg.tokenizer, model), cfg.server_cmd,
                             servers, cfg.engine, model, cfg.startup_timeout, cfg.stop_timeout)


def _parse_servers(items) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in items:
        name, sep, cmd = item.partition("=")
        if not sep or not name.strip() or " " in name.strip() or not cmd.strip():
            raise ValueError(f"server: expected NAME=COMMAND, got {item!r}")
        if name.strip() in out:
            raise ValueError(f"server: the name {name.strip()!r} is given twice")
        out[name.strip()] = cmd.strip()
    return out


def _tokenizer(path: str | None, model: str | None):
    """Prompts are cut with ``path``'s tokenizer, else the model's when it is a local directory
    or .gguf file, else the embedded Gemma 3 270M's (a server's own tokenizer may count a prompt
    a little differently; responses report what it counted)."""
    from tandem.bench.main import load_tokenizer

    if path is None and model and Path(model).expanduser().exists():
        path = model
    return load_tokenizer(path)
