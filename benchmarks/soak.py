"""A soak run: `tandem serve` as a subprocess, kept at about three times its capacity for a few
thousand requests, with faults mixed in (malformed bodies, clients that hang up mid-stream, slow
readers, bursts). Reports what became of every request (completed, refused with 429 and retried,
refused as malformed, deliberately disconnected, errors, hung), the server's RSS over time, and
its KV usage and queues once the load stops; then stops the server with SIGINT and records how it
exited and whether it logged tracebacks.

    .venv/bin/python benchmarks/soak.py --requests 2000 --out-dir docs/results/soak
    .venv/bin/python benchmarks/soak.py --model default --requests 1000   # the default Gemma model

By default the model is a tiny random llama (tests/tiny_models.py, so the run measures the server,
not the arithmetic); ``--model default`` serves tandem's default model, any other value is passed to
``--model``. Writes soak.json, soak.md and soak.png to --out-dir.

Longer than 300 lines: the server's lifecycle, the load with its faults, the sampler and the report
are one run, read together; split, each part would only make sense beside the others.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx

from tandem.bench.launch import ServerProcess, free_port

ROOT = Path(__file__).resolve().parent.parent
KINDS = {  # kind: share of the requests
    "stream": 0.30, "complete": 0.15, "chat": 0.10, "malformed": 0.15, "disconnect": 0.15, "slow_reader": 0.15,
}
MALFORMED = [  # (content type, body): each must get a 4xx, never a 5xx
    ("application/json", b"{not json"),
    ("application/json", b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
    ("application/json", b'{"prompt": "a\\ud800b", "max_tokens": 4}'),
    ("application/json", b'{"messages": [{"role": "user", "content": "a\\ud800b"}], "max_tokens": 4}'),
    ("application/json", b'{"prompt": "Hi", "max_tokens": 4, "temperature": 1, "seed": 18446744073709551616}'),
    ("application/json", b'{"prompt": "Hi", "max_tokens": 4, "seed": ' + b"9" * 5000 + b"}"),
    ("application/json", b'{"prompt": "Hi", "max_tokens": 4.5}'),
    ("application/json", b'{"prompt": "Hi", "n": 0}'),
    ("application/json", b'{"prompt": "Hi", "model": "no-such-model"}'),
    ("application/json", b'{"prompt": "Hi", "logprobs": 99}'),
    ("application/json", b'\xff\xfe{"prompt": "Hi"}'),
    ("text/plain", b'{"prompt": "Hi", "max_tokens": 4}'),
]


def rss_bytes(pid: int) -> int | None:
    try:
        import psutil

        return psutil.Process(pid).memory_info().rss
    except ImportError:
        pass
    except Exception:  # noqa: BLE001 - the process may have exited
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def parse_metrics(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("tandem:"):
            name, value = line.rsplit(" ", 1)
            out[name.split("{")[0]] = out.get(name.split("{")[0], 0.0) + float(value)
    return out


class Server(ServerProcess):
    def __init__(self, model_args: list[str], extra: list[str]) -> None:
        self.port = free_port()
        env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        super().__init__([sys.executable, "-m", "tandem.cli", "serve", "--port", str(self.port), *model_args, *extra],
                         f"http://127.0.0.1:{self.port}", env=env)


class Soak:
    def __init__(self, args: argparse.Namespace, server: Server) -> None:
        self.args = args
        self.server = server
        self.rng = random.Random(args.seed)
        self.outcomes: Counter = Counter()  # (kind, outcome)
        self.refusals = 0
        self.refusals_without_retry_after = 0
        self.errors: list[str] = []
        self.latencies: list[float] = []
        self.in_flight = 0
        self.samples: list[dict] = []  # t, rss, in_flight, done

    def plan(self) -> list[str]:
        kinds = list(KINDS)
        return self.rng.choices(kinds, weights=[KINDS[k] for k in kinds], k=self.args.requests)

    async def one(self, http: httpx.AsyncClient, i: int, kind: str) -> str:
        rng = random.Random(self.args.seed * 1_000_003 + i)
        max_tokens = rng.randint(self.args.min_tokens, self.args.max_tokens)
        prompt = " ".join(f"w{rng.randint(3, 300)}" for _ in range(rng.randint(2, 24)))
        if kind == "malformed":
            ctype, raw = MALFORMED[i % len(MALFORMED)]
            r = await http.post("/v1/completions", content=raw, headers={"Content-Type": ctype})
            if 400 <= r.status_code < 500 and "error" in r.json():
                return "refused_malformed"
            raise AssertionError(f"malformed body {i % len(MALFORMED)}: {r.status_code} {r.text[:200]}")
        chat = kind == "chat"
        path = "/v1/chat/completions" if chat else "/v1/completions"
        body: dict = {"max_tokens": max_tokens, "ignore_eos": True, "temperature": 1, "seed": i}
        body.update({"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt})
        body["stream"] = kind != "complete"
        for _ in range(self.args.retries + 1):
            start = time.monotonic()
            async with http.stream("POST", path, json=body) as r:
                if r.status_code == 429:
                    await r.aread()
                    self.refusals += 1
                    wait = r.headers.get("retry-after")
                    if wait is None:
                        self.refusals_without_retry_after += 1
                    await asyncio.sleep(float(wait or 1))
                    continue
                if r.status_code != 200:
                    raise AssertionError(f"{kind}: {r.status_code} {(await r.aread())[:200]!r}")
                if kind == "complete":
                    data = json.loads(await r.aread())
                    assert data["usage"]["completion_tokens"] == max_tokens, data["usage"]
                    self.latencies.append(time.monotonic() - start)
                    return "completed"
                lines = 0
                last = ""
                hang_up_after = rng.randint(1, 4)
                async for line in r.aiter_lines():
                    if not line:
                        continue
                    lines += 1
                    last = line
                    if '"error"' in line:
                        raise AssertionError(f"{kind}: error event {line[:200]}")
                    if kind == "disconnect" and lines >= hang_up_after:
                        return "disconnected"
                    if kind == "slow_reader":
                        await asyncio.sleep(self.args.slow_read_s)
                if last != "data: [DONE]":
                    raise AssertionError(f"{kind}: stream ended without [DONE] (last line {last[:120]!r})")
                self.latencies.append(time.monotonic() - start)
                return "completed"
        return "refused_gave_up"

    async def guarded(self, http: httpx.AsyncClient, i: int, kind: str, progress, task) -> None:
        self.in_flight += 1
        try:
            outcome = await asyncio.wait_for(self.one(http, i, kind), self.args.hang_s)
        except (asyncio.TimeoutError, httpx.TimeoutException):
            outcome = "hung"
        except Exception as exc:  # noqa: BLE001 - every failure is counted and kept
            outcome = "error"
            if len(self.errors) < 50:
                self.errors.append(f"{kind} #{i}: {type(exc).__name__}: {exc}"[:400])
        finally:
            self.in_flight -= 1
        self.outcomes[kind, outcome] += 1
        progress.update(task, advance=1, description=self._line())

    def _line(self) -> str:
        done = Counter()
        for (_, outcome), n in self.outcomes.items():
            done[outcome] += n
        return (f"done {done['completed']} | hung-up {done['disconnected']} | 429s {self.refusals} | "
                f"4xx {done['refused_malformed']} | errors {done['error']} | hung {done['hung']}")

    async def sample(self, start: float, stop: asyncio.Event) -> None:
        while not stop.is_set():
            self.samples.append({"t": round(time.monotonic() - start, 3), "rss": rss_bytes(self.server.proc.pid),
                                 "in_flight": self.in_flight, "done": sum(self.outcomes.values())})
            try:
                await asyncio.wait_for(stop.wait(), self.args.sample_s)
            except asyncio.TimeoutError:
                pass

    async def run(self) -> float:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        kinds = self.plan()
        limits = httpx.Limits(max_connections=self.args.concurrency + 8, max_keepalive_connections=self.args.concurrency)
        gate = asyncio.Semaphore(self.args.concurrency)
        start = time.monotonic()
        stop = asyncio.Event()
        sampler = asyncio.ensure_future(self.sample(start, stop))
        async with httpx.AsyncClient(base_url=self.server.url, limits=limits,
                                     timeout=httpx.Timeout(self.args.hang_s)) as http:
            with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                          TimeElapsedColumn()) as progress:
                task = progress.add_task(self._line(), total=len(kinds))

                async def gated(i: int, kind: str) -> None:
                    async with gate:
                        await self.guarded(http, i, kind, progress, task)

                tasks, i = [], 0
                while i < len(kinds):  # bursts: a random number of requests at once, then a pause
                    burst = self.rng.randint(1, self.args.burst)
                    tasks += [asyncio.ensure_future(gated(j, kinds[j])) for j in range(i, min(i + burst, len(kinds)))]
                    i += burst
                    await asyncio.sleep(self.rng.expovariate(1 / self.args.burst_gap_s))
                await asyncio.gather(*tasks)
        took = time.monotonic() - start
        stop.set()
        await sampler
        return took


def settle(url: str, timeout: float = 60) -> dict[str, float]:
    """/metrics once nothing is running or waiting (or at the timeout)."""
    deadline = time.time() + timeout
    while True:
        m = parse_metrics(httpx.get(url + "/metrics", timeout=10).text)
        idle = m.get("tandem:num_requests_running", 0) == 0 and m.get("tandem:num_requests_waiting", 0) == 0
        if (idle and m.get("tandem:kv_cache_usage_perc", 0) == 0) or time.time() > deadline:
            return m
        time.sleep(0.2)


def write_report(out_dir: Path, result: dict, samples: list[dict]) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "soak.json").write_text(json.dumps({**result, "samples": samples}, indent=1))
    t = result["totals"]
    lines = [
        "# Soak run", "",
        f"`{result['command']}` at commit `{result['commit']}`, {result['requests']} requests, "
        f"concurrency {result['concurrency']}, {result['wall_s']:.1f} s.", "",
        "| outcome | requests |", "|---|---|",
        *[f"| {k} | {v} |" for k, v in t.items()],
        f"| 429 answers (each retried after Retry-After) | {result['refusals_429']} |",
        f"| 429 answers without Retry-After | {result['refusals_without_retry_after']} |", "",
        "| kind | " + " | ".join(t) + " |", "|---|" + "---|" * len(t),
        *[f"| {k} | " + " | ".join(str(v.get(o, 0)) for o in t) + " |" for k, v in result["by_kind"].items()], "",
        f"Completed latency: p50 {result['latency_s']['p50']:.3f} s, p99 {result['latency_s']['p99']:.3f} s, "
        f"max {result['latency_s']['max']:.3f} s.", "",
        f"Server RSS: start {result['rss_mib']['start']:.0f} MiB, peak {result['rss_mib']['peak']:.0f} MiB, "
        f"end {result['rss_mib']['end']:.0f} MiB.", "",
        f"At the end: KV usage {result['end']['kv_cache_usage_perc']}, running {result['end']['running']}, "
        f"waiting {result['end']['waiting']}; SIGINT exit code {result['exit']['code']} after "
        f"{result['exit']['seconds']:.1f} s; {result['exit']['tracebacks']} traceback lines in the server log.",
    ]
    if result["errors"]:
        lines += ["", "First errors:", "", *[f"- `{e}`" for e in result["errors"][:10]]]
    (out_dir / "soak.md").write_text("\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    ts = [s["t"] for s in samples]
    fig, (a, b) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    mib = [(s["rss"] or 0) / 2 ** 20 for s in samples]
    a.plot(ts, mib)
    a.set_ylabel("server RSS (MiB)")
    a.set_ylim(0, max(mib + [1]) * 1.15)
    b.plot(ts, [s["in_flight"] for s in samples], label="in flight")
    b.plot(ts, [s["done"] for s in samples], label="finished (any outcome)")
    b.set_xlabel("seconds")
    b.legend()
    fig.suptitle(f"soak: {result['requests']} requests, concurrency {result['concurrency']}")
    fig.tight_layout()
    fig.savefig(out_dir / "soak.png", dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--concurrency", type=int, default=72, help="clients at once (3x the default capacity)")
    p.add_argument("--model", default="tiny", help="'tiny' (random, built here), 'default', or a --model value")
    p.add_argument("--server-args", default="--max-num-seqs 8 --max-waiting 16 --admission-queue 16 --admission-timeout 2",
                   help="extra `tandem serve` flags (the default keeps capacity at 24 requests, and 16 more in line for admission for up to 2 s, so overload is refused with 429s)")
    p.add_argument("--min-tokens", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--retries", type=int, default=3, help="times a refused (429) request is retried")
    p.add_argument("--burst", type=int, default=24, help="largest number of requests sent at once")
    p.add_argument("--burst-gap-s", type=float, default=0.2, help="mean pause between bursts")
    p.add_argument("--slow-read-s", type=float, default=0.05, help="a slow reader's pause between lines")
    p.add_argument("--hang-s", type=float, default=120, help="a request still open after this is hung")
    p.add_argument("--sample-s", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", type=Path, default=ROOT / "docs" / "results" / "soak")
    args = p.parse_args(argv)

    tmp = None
    if args.model == "tiny":
        sys.path.insert(0, str(ROOT / "tests"))
        from tiny_models import save_tiny

        tmp = tempfile.TemporaryDirectory()
        save_tiny("llama", Path(tmp.name), max_position_embeddings=2048)
        model_args = ["--model", tmp.name, "--served-model-name", "tiny", "--dtype", "float32",
                      "--peak-flops", "1e11", "--peak-memory-bandwidth", "1e10"]
    elif args.model == "default":
        model_args = []
    else:
        model_args = ["--model", args.model]
    server = Server(model_args, args.server_args.split())
    soak = Soak(args, server)
    try:
        wall = asyncio.run(soak.run())
        end = settle(server.url)
    finally:
        code, exit_s = server.stop()
        if tmp is not None:
            tmp.cleanup()
    totals: Counter = Counter()
    by_kind: dict[str, Counter] = {}
    for (kind, outcome), n in sorted(soak.outcomes.items()):
        totals[outcome] += n
        by_kind.setdefault(kind, Counter())[outcome] += n
    order = ["completed", "disconnected", "refused_malformed", "refused_gave_up", "error", "hung"]
    rss = [s["rss"] for s in soak.samples if s["rss"]] or [0]
    lat = sorted(soak.latencies) or [0.0]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    result = {
        "command": "benchmarks/soak.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "commit": commit, "server_command": " ".join(server.cmd[1:]), "requests": args.requests,
        "concurrency": args.concurrency, "wall_s": wall,
        "totals": {k: totals.get(k, 0) for k in order},
        "by_kind": {k: {o: v.get(o, 0) for o in order} for k, v in by_kind.items()},
        "refusals_429": soak.refusals, "refusals_without_retry_after": soak.refusals_without_retry_after,
        "latency_s": {"p50": statistics.median(lat), "p99": lat[min(len(lat) - 1, int(0.99 * len(lat)))],
                      "max": lat[-1]},
        "rss_mib": {"start": rss[0] / 2 ** 20, "peak": max(rss) / 2 ** 20, "end": rss[-1] / 2 ** 20},
        "end": {"kv_cache_usage_perc": end.get("tandem:kv_cache_usage_perc"),
                "running": end.get("tandem:num_requests_running"),
                "waiting": end.get("tandem:num_requests_waiting")},
        "exit": {"code": code, "seconds": exit_s, "tracebacks": sum("Traceback" in line for line in server.log)},
        "errors": soak.errors,
    }
    write_report(args.out_dir, result, soak.samples)
    print((args.out_dir / "soak.md").read_text())
    bad = totals["error"] or totals["hung"] or end.get("tandem:kv_cache_usage_perc") or code != 0
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
