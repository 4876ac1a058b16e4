"""Run a workload: send requests on their arrival schedule, bounded by count, concurrency and time.

Two backends share the measurement: ``openai`` streams from any OpenAI-compatible server over
HTTP (and scrapes its /metrics while it runs); ``inprocess`` drives tandem's engine directly,
free of HTTP, reading each request's timing from the engine.
"""

from __future__ import annotations

import asyncio
import math
import re
import time
from dataclasses import dataclass, field
from typing import Callable

import httpx

from tandem.bench.client import RequestResult, request_body, send
from tandem.bench.workload import ArrivalSpec

from tandem.bench.prompts import BenchRequest
from tandem.core.burst_pause import END_REASONS
from tandem.core.step import SIZING_LIMITS

# Gauges read from /metrics while a run goes; tandem's names first, then vLLM's, SGLang's and
# llama-server's (the engine presets of tandem.bench.presets say which switch turns them on).
SCRAPED = {
    "running": ("tandem:num_requests_running", "vllm:num_requests_running", "sglang:num_running_reqs",
                "llamacpp:requests_processing"),
    "waiting": ("tandem:num_requests_waiting", "vllm:num_requests_waiting", "sglang:num_queue_reqs",
                "llamacpp:requests_deferred"),
    "kv_usage": ("tandem:kv_cache_usage_perc", "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc",
                 "sglang:token_usage"),
    "mfu": ("tandem:model_flops_utilization",),
    "mbu": ("tandem:memory_bandwidth_utilization",),
    "busy": ("tandem:engine_busy_fraction",),
    "recomputed_tokens": ("tandem:recomputed_tokens_total",),  # a counter: a run reads its delta
    "prefix_cache_queries": ("tandem:prefix_cache_queries_total", "vllm:prefix_cache_queries_total"),  # counters
    "prefix_cache_hits": ("tandem:prefix_cache_hits_total", "vllm:prefix_cache_hits_total"),
    "itl_target": ("tandem:itl_target_seconds",),  # the ITL target the last step was sized to (0: none)
    # counters of the steps sized under an ITL target, by what set their prompt work (one label)
    **{f"sized_{limit}": (f'tandem:itl_sized_steps_total{{limit="{limit}"}}',) for limit in SIZING_LIMITS},
    # counters of the burst pauses ended, by why (one label)
    **{f"pause_end_{reason}": (f'tandem:burst_pause_ends_total{{reason="{reason}"}}',) for reason in END_REASONS},
}
_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse_gauges(text: str) -> dict[str, float]:
    """The ``SCRAPED`` values of one /metrics page: each family summed over its series, and where a
    name says one label (``name{label="value"}``), over the series with that label value."""
    totals: dict[str, float] = {}
    for line in text.splitlines():
        m = _LINE.match(line)
        if m:
            try:
                value = float(m.group(3))
            except ValueError:
                continue
            keys = [m.group(1)] + [f'{m.group(1)}{{{k}="{v}"}}' for k, v in _LABEL.findall(m.group(2) or "")]
            for key in keys:
                totals[key] = totals.get(key, 0.0) + value
    out = {}
    for key, names in SCRAPED.items():
        for name in names:
            if name in totals:
                out[key] = totals[name]
                break
    return out


@dataclass
class RunData:
    results: list[RequestResult]
    duration: float
    samples: list[tuple[float, dict[str, float]]] = field(default_factory=list)
    """(time on the run's clock, scraped gauges)."""
    notes: list[str] = field(default_factory=list)


Progress = Callable[[RequestResult], None]


async def _scrape_once(client: httpx.AsyncClient, url: str, clock, out: list) -> None:
    try:
        r = await client.get(url, timeout=5)
    except httpx.HTTPError:
        return
    gauges = parse_gauges(r.text) if r.status_code == 200 else {}
    if gauges:
        out.append((clock(), gauges))


async def _scrape(client: httpx.AsyncClient, url: str, clock, interval: float, out: list, notes: list[str]) -> None:
    while True:
        try:
            r = await client.get(url, timeout=5)
            if r.status_code != 200:
                notes.append(f"/metrics answered {r.status_code}; server metrics were not recorded")
                return
            gauges = parse_gauges(r.text)
            if gauges:
                out.append((clock(), gauges))
        except httpx.HTTPError as exc:
            notes.append(f"/metrics scrape failed: {exc}")
            return
        await asyncio.sleep(interval)


async def run_openai(
    requests: list[BenchRequest],
    offsets: list[float],
    arrival: ArrivalSpec,
    base_url: str,
    endpoint: str,
    model: str | None,
    ignore_eos: bool,
    headers: dict[str, str],
    timeout: float,
    max_duration: float,
    scrape_interval: float,
    progress: Progress | None = None,
) -> RunData:
    chat = "chat" in endpoint
    url = base_url.rstrip("/") + endpoint
    sem = asyncio.Semaphore(arrival.max_concurrency) if arrival.max_concurrency else None
    t0 = time.perf_counter()

    def clock() -> float:
        return time.perf_counter() - t0

    samples: list = []
    notes: list[str] = []
    limits = httpx.Limits(max_connections=max(16, (arrival.max_concurrency or len(requests)) + 4),
                          max_keepalive_connections=64)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        scraper = asyncio.ensure_future(
            _scrape(client, base_url.rstrip("/") + "/metrics", clock, scrape_interval, samples, notes))

        async def launch(req: BenchRequest, offset: float) -> RequestResult:
            delay = offset - clock()
            if delay > 0:
                await asyncio.sleep(delay)
            body = request_body(req, model, chat, ignore_eos)
            if sem is None:
                res = await send(client, url, req, body, clock, headers, timeout)
            else:
                async with sem:
                    res = await send(client, url, req, body, clock, headers, timeout)
            if progress:
                progress(res)
            return res

        tasks = [asyncio.ensure_future(launch(r, o)) for r, o in zip(requests, offsets)]
        done, pending = await asyncio.wait(tasks, timeout=max_duration)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        scraper.cancel()
        await asyncio.gather(scraper, return_exceptions=True)
        if samples:  # one last reading, so counters' deltas cover the whole run
            await _scrape_once(client, base_url.rstrip("/") + "/metrics", clock, samples)
        duration = clock()
    results = []
    for req, task in zip(requests, tasks):
        if task in done and not task.cancelled() and task.exception() is None:
            results.append(task.result())
        else:
            results.append(RequestResult.of(req, math.nan, error="not finished within --max-duration"))
    if pending:
        notes.append(f"{len(pending)} requests were still running when --max-duration ({max_duration} s) ended the run")
    return RunData(results, duration, samples, notes)


def run_inprocess(
    engine,
    requests: list[BenchRequest],
    offsets: list[float],
    arrival: ArrivalSpec,
    ignore_eos: bool,
    max_duration: float,
    progress: Progress | None = None,
) -> RunData:
    """Drive a tandem ``Engine`` directly; timings come from the engine's own clock."""
    from tandem.core.sampling_params import SamplingParams

    clock0 = engine.clock()

    def clock() -> float:
        return engine.clock() - clock0

    order = sorted(range(len(requests)), key=lambda i: offsets[i])
    nxt = 0
    in_flight: dict[str, int] = {}
    results: dict[int, RequestResult] = {}
    samples: list = []
    limit = arrival.max_concurrency or math.inf
    freed_at = 0.0  # when --max-concurrency last let a waiting request go
    sized = dict.fromkeys(SIZING_LIMITS, 0)  # steps sized under an ITL target, as the server counts them
    pause_ends = dict.fromkeys(END_REASONS, 0)  # burst pauses ended, by why
    samples.append((0.0, {**{f"sized_{limit}": 0 for limit in sized},  # the counters' start: deltas count every step
                          **{f"pause_end_{reason}": 0 for reason in pause_ends}}))
    itl_target = 0.0  # as the server's gauge: the last step with running streams'
    while (nxt < len(order) or in_flight) and clock() < max_duration:
        while nxt < len(order) and offsets[order[nxt]] <= clock() and len(in_flight) < limit:
            i = order[nxt]
            nxt += 1
            req = requests[i]
            params = SamplingParams(max_tokens=req.output_len, temperature=0.0, ignore_eos=ignore_eos)
            # it arrived at its offset (or when a place freed up), not when the step running then
            # ended: that wait is part of its TTFT, as a client of a server would see it
            sent = max(offsets[i], freed_at)
            res = RequestResult.of(req, sent)
            try:
                rid = engine.add_request(req.prompt, params, user=req.user, arrival_time=clock0 + sent)
            except ValueError as exc:
                res.error = f"rejected: {exc}"
                results[i] = res
                if progress:
                    progress(res)
                continue
            in_flight[rid] = i
            results[i] = res
        if not engine.has_unfinished_requests():
            if nxt < len(order) and len(in_flight) < limit:
                if hasattr(engine.clock, "advance_to"):  # a simulator's virtual clock: jump ahead
                    engine.clock.advance_to(clock0 + offsets[order[nxt]])
                else:
                    time.sleep(max(0.0, min(offsets[order[nxt]] - clock(), 0.05)))
            continue
        for out in engine.step():
            if not out.finished:
                continue
            full = len(in_flight) >= limit
            i = in_flight.pop(out.request_id)
            res = results[i]
            t = out.timing
            if full:
                freed_at = max(freed_at, (t.finish or engine.clock()) - clock0)
            res.prompt_tokens = len(out.prompt_token_ids)
            res.cached_tokens = out.num_cached_tokens
            res.output_tokens = len(out.token_ids)
            res.token_times = [x - clock0 for x in t.token_times]
            res.finish_time = (t.finish or engine.clock()) - clock0
            res.success = out.finish_reason in ("length", "stop") and bool(out.token_ids)
            if not res.success:
                res.error = out.error or f"finished with {out.finish_reason}"
            if progress:
                progress(res)
        if engine.step_stats:
            s = engine.step_stats[-1]
            if s.sizing is not None:
                sized[s.sizing.limit] += 1
                if s.sizing.pause_end:
                    pause_ends[s.sizing.pause_end] += 1
            itl_target = s.sizing.target_seconds if s.sizing is not None else 0.0 if s.num_decode_tokens else itl_target
            samples.append((s.start + s.duration - clock0, {
                "running": s.num_running, "waiting": s.num_waiting,
                "kv_usage": s.kv_blocks_used / s.kv_blocks_total, "itl_target": itl_target,
                **{f"sized_{limit}": n for limit, n in sized.items()},
                **{f"pause_end_{reason}": n for reason, n in pause_ends.items()},
            }))
    for rid in list(in_flight):
        engine.abort_request(rid)
    unfinished = [i for i in range(len(requests))
                  if i not in results or (not results[i].success and results[i].error is None)]
    for i in unfinished:
        req = requests[i]
        results[i] = RequestResult.of(req, math.nan, error="not finished within --max-duration")
    notes = [f"--max-duration ({max_duration} s) ended the run early"] if unfinished else []
    return RunData([results[i] for i in range(len(requests))], clock(), samples, notes)
