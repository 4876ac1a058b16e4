"""tandem bench: measurement against a fake server with injected delays, arrival statistics,
workload files, and an end-to-end run against a real tandem server."""

from __future__ import annotations

import asyncio
import json
import math
import statistics
import threading
import time

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from tandem.bench.arrivals import arrival_offsets
from tandem.bench.config import BenchConfig
from tandem.bench.main import run_bench, workload_from_config
from tandem.bench.replay import parse_gauges, run_openai
from tandem.bench.summary import parse_goodput, summarize_run
from tandem.bench.prompts import BenchRequest, build_requests
from tandem.bench.workload import ArrivalSpec, LengthDist, RequestClass, Workload
from test_server import Server, free_port
from tiny_models import save_tiny

TTFT_S = 0.120
ITL_S = 0.030


class WordTokenizer:
    """Each word is a token: lengths are easy to check."""

    def encode(self, text: str) -> list[int]:
        return [hash(w) % 1000 for w in text.split()]

    def decode(self, ids) -> str:
        return " ".join(f"t{i}" for i in ids)


def fake_app() -> FastAPI:
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        if "FAIL" in body["prompt"]:
            return JSONResponse({"error": {"message": "injected failure", "type": "server_error"}}, status_code=500)
        n = body["max_tokens"]

        async def stream():
            await asyncio.sleep(TTFT_S)
            for i in range(n):
                if i:
                    await asyncio.sleep(ITL_S)
                yield f"data: {json.dumps({'choices': [{'index': 0, 'text': f' w{i}'}]})}\n\n"
            usage = {"prompt_tokens": len(body["prompt"].split()), "completion_tokens": n,
                     "total_tokens": n + len(body["prompt"].split())}
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse('vllm:num_requests_running{model_name="m"} 3\nvllm:num_requests_waiting 1\n'
                                 'vllm:gpu_cache_usage_perc 0.25\n')

    return app


@pytest.fixture(scope="module")
def fake_server():
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(fake_app(), host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)


def _run(url, requests, arrival):
    offsets = arrival_offsets(arrival, len(requests), 0)
    return asyncio.run(run_openai(requests, offsets, arrival, url, "/v1/completions", "m", True, {}, 30, 60, 0.1))


def test_measures_injected_latencies(fake_server):
    reqs = [BenchRequest(i, "c", "a b c d", 4, 10) for i in range(8)]
    data = _run(fake_server, reqs, ArrivalSpec(request_rate=math.inf, max_concurrency=4))
    s = summarize_run(data.results, data.duration, [50, 99])
    assert s["completed"] == 8 and s["failed"] == 0
    assert s["total_output_tokens"] == 80 and s["total_input_tokens"] == 32
    # each measured value sits just above what the server injected (scheduling jitter only)
    # (the fake server shares this process and a 2-core machine: allow tens of ms of jitter)
    assert TTFT_S * 1000 <= s["median_ttft_ms"] <= TTFT_S * 1000 + 60
    assert ITL_S * 1000 * 0.9 <= s["median_itl_ms"] <= ITL_S * 1000 + 15
    assert ITL_S * 1000 <= s["median_tpot_ms"] * 1.02 <= ITL_S * 1000 + 15
    expected_e2e = TTFT_S + 9 * ITL_S
    assert expected_e2e * 1000 <= s["median_e2el_ms"] <= expected_e2e * 1000 + 120
    # 2 waves of 4 requests, each wave lasting one e2e
    assert s["output_throughput"] == pytest.approx(80 / data.duration)
    assert 2 * expected_e2e <= data.duration <= 2 * expected_e2e + 0.8
    assert data.samples and data.samples[0][1] == {"running": 3.0, "waiting": 1.0, "kv_usage": 0.25}


def test_errors_are_counted_with_reasons(fake_server):
    reqs = [BenchRequest(i, "c", "FAIL" if i % 3 == 0 else "ok", 1, 3) for i in range(6)]
    data = _run(fake_server, reqs, ArrivalSpec(request_rate=math.inf))
    s = summarize_run(data.results, data.duration, [50])
    assert s["completed"] == 4 and s["failed"] == 2
    assert s["errors"] == {"HTTP 500: injected failure": 2}


def test_goodput():
    assert parse_goodput(["ttft:500", "tpot:50"]) == {"ttft": 0.5, "tpot": 0.05}
    for bad in (["ttft"], ["itl:5"], ["ttft:x"], ["ttft:-1"]):
        with pytest.raises(ValueError, match="goodput"):
            parse_goodput(bad)


@pytest.mark.parametrize("process, burstiness, cv", [("poisson", 1.0, 1.0), ("gamma", 0.25, 2.0),
                                                     ("gamma", 4.0, 0.5), ("constant", 1.0, 0.0)])
def test_arrival_processes_have_requested_rate_and_dispersion(process, burstiness, cv):
    offsets = arrival_offsets(ArrivalSpec(process, request_rate=10.0, burstiness=burstiness), 5000, seed=1)
    gaps = [b - a for a, b in zip(offsets, offsets[1:])]
    mean = statistics.fmean(gaps)
    assert mean == pytest.approx(0.1, rel=0.05)
    # coefficient of variation of a gamma with shape k is 1/sqrt(k)
    assert statistics.pstdev(gaps) / mean == pytest.approx(cv, abs=0.1 * max(cv, 0.1))


def test_infinite_rate_and_validation():
    assert arrival_offsets(ArrivalSpec(request_rate=math.inf), 5, 0) == [0.0] * 5
    with pytest.raises(ValueError, match="request_rate"):
        arrival_offsets(ArrivalSpec(request_rate=0), 5, 0)
    with pytest.raises(ValueError, match="burstiness"):
        arrival_offsets(ArrivalSpec(request_rate=1, burstiness=0), 5, 0)


def test_length_distributions():
    import random

    rng = random.Random(0)
    logn = [LengthDist("lognormal", 300, sigma=0.6).sample(rng) for _ in range(20000)]
    assert statistics.fmean(logn) == pytest.approx(300, rel=0.03)
    uni = [LengthDist("uniform", 0, min=10, max=20).sample(rng) for _ in range(5000)]
    assert min(uni) == 10 and max(uni) == 20
    assert {LengthDist("fixed", 7).sample(rng) for _ in range(10)} == {7}
    with pytest.raises(ValueError, match="dist"):
        LengthDist("cauchy").validate("x")


def test_mixed_workload_file_roundtrip(tmp_path):
    w = Workload(dataset="mixed", num_prompts=2000, seed=3, classes=[
        RequestClass("chat", 0.75, LengthDist("lognormal", 40, sigma=0.4), LengthDist("fixed", 20)),
        RequestClass("docs", 0.25, LengthDist("uniform", 0, min=100, max=200), LengthDist("fixed", 8), prefix_len=10),
    ], arrival=ArrivalSpec("gamma", request_rate=4.0, burstiness=0.5, max_concurrency=8))
    for name in ("w.yaml", "w.json"):
        w.save(tmp_path / name)
        assert Workload.load(tmp_path / name) == w
    reqs = build_requests(w, WordTokenizer())
    share = sum(r.class_name == "chat" for r in reqs) / len(reqs)
    assert share == pytest.approx(0.75, abs=0.03)
    docs = [r for r in reqs if r.class_name == "docs"]
    assert all(100 <= r.input_len <= 200 and r.output_len == 8 for r in docs)
    # prompts are real text cut to the drawn token length; the class shares a prefix
    assert all(len(WordTokenizer().encode(r.prompt)) == r.input_len for r in docs[:50])
    assert len({" ".join(r.prompt.split()[:10]) for r in docs}) == 1
    (tmp_path / "bad.yaml").write_text("dataset: mixed\nclasses: [{name: x, share: -1}]\n")
    with pytest.raises(ValueError, match="share"):
        Workload.load(tmp_path / "bad.yaml")


class CharTokenizer:
    """One token per character: a token stream of another length than WordTokenizer's."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) % 1000 for c in text]

    def decode(self, ids) -> str:
        return "".join(chr(97 + i % 26) for i in ids)


def test_drawn_lengths_do_not_depend_on_the_tokenizer():
    # the simulator cuts a workload with its own tokenizer: it must see the same requests
    w = Workload(dataset="mixed", num_prompts=200, seed=5, classes=[
        RequestClass("chat", 0.5, LengthDist("lognormal", 60, sigma=0.8, max=400), LengthDist("lognormal", 30)),
        RequestClass("docs", 0.5, LengthDist("uniform", 0, min=50, max=300), LengthDist("fixed", 8), prefix_len=10),
    ])
    def shape(tok):
        return [(r.class_name, r.input_len, r.output_len) for r in build_requests(w, tok)]
    assert shape(WordTokenizer()) == shape(CharTokenizer())


def test_trace_replay(tmp_path):
    trace = tmp_path / "trace.jsonl"
    trace.write_text("\n".join(json.dumps({"timestamp": 100 + t, "input_len": 5 + i, "output_len": 3, "class": c})
                               for i, (t, c) in enumerate([(0.0, "a"), (0.5, "b"), (2.0, "a")])))
    w = Workload(dataset="trace", dataset_path=str(trace), num_prompts=10)
    reqs = build_requests(w, WordTokenizer())
    assert [r.arrival_s for r in reqs] == [0.0, 0.5, 2.0]
    assert [r.class_name for r in reqs] == ["a", "b", "a"] and [r.input_len for r in reqs] == [5, 6, 7]
    trace.write_text("{not json}\n")
    with pytest.raises(ValueError, match="line 1"):
        build_requests(w, WordTokenizer())


def test_sharegpt_dataset(tmp_path):
    path = tmp_path / "sg.json"
    path.write_text(json.dumps([{"conversations": [{"from": "human", "value": f"question number {i}"},
                                                   {"from": "gpt", "value": "answer"}]} for i in range(5)]))
    cfg = BenchConfig(dataset_name="sharegpt", dataset_path=str(path), num_prompts=7, sharegpt_output_len=12)
    reqs = build_requests(workload_from_config(cfg), WordTokenizer())
    assert len(reqs) == 7 and all(r.output_len == 12 and r.prompt.startswith("question") for r in reqs)


def test_parse_gauges_prefers_tandem_names():
    text = ('tandem:num_requests_running{model_name="a"} 2\ntandem:num_requests_running{model_name="b"} 1\n'
            'vllm:num_requests_running 9\n# HELP x\ntandem:kv_cache_usage_perc{model_name="a"} 0.5\n')
    assert parse_gauges(text) == {"running": 3.0, "kv_usage": 0.5}



def test_parse_gauges_reads_one_label_of_a_family():
    text = ('tandem:itl_sized_steps_total{limit="itl",model_name="a"} 7\n'
            'tandem:itl_sized_steps_total{limit="overrun",model_name="a"} 2\n'
            'tandem:itl_sized_steps_total{limit="itl",model_name="b"} 1\n'
            'tandem:itl_target_seconds{model_name="a"} 0.25\n'
            'tandem:burst_pause_ends_total{model_name="a",reason="gate"} 3\n')
    # summed over the series with that label, whatever their other labels; a limit not exported is absent
    assert parse_gauges(text) == {"sized_itl": 8.0, "sized_overrun": 2.0, "itl_target": 0.25, "pause_end_gate": 3.0}


def test_sizing_summary_counts_the_runs_steps_and_its_median_target():
    from tandem.bench.summary import sizing_summary

    samples = [(0.0, {"sized_itl": 5, "sized_ttft": 0, "sized_overrun": 1, "itl_target": 0.0, "pause_end_done": 0}),
               (1.0, {"sized_itl": 9, "sized_ttft": 2, "sized_overrun": 1, "itl_target": 0.2, "pause_end_done": 1}),
               (2.0, {"sized_itl": 12, "sized_ttft": 2, "sized_overrun": 4, "itl_target": 0.3, "pause_end_done": 1,
                      "pause_end_gate": 0}),
               (3.0, {"sized_itl": 12, "sized_ttft": 2, "sized_overrun": 4, "itl_target": 0.4, "pause_end_done": 3,
                      "pause_end_gate": 2})]
    assert sizing_summary(samples) == {"steps_sized_itl": 7, "steps_sized_ttft": 2, "steps_sized_overrun": 3,
                                       "pause_ends_done": 3, "pause_ends_gate": 2, "median_itl_target_ms": 300.0}
    assert sizing_summary([(0.0, {"running": 1})]) == {}  # not tandem, or no target: nothing to say


@pytest.fixture(scope="module")
def tandem_server(tmp_path_factory):
    d = tmp_path_factory.mktemp("bench-model")
    save_tiny("llama", d)
    s = Server(d, "--peak-flops", "1e11", "--peak-memory-bandwidth", "1e10", "--max-num-batched-tokens", "64")
    yield s, d
    s.stop()


def test_end_to_end_against_tandem(tandem_server, tmp_path):
    server, model_dir = tandem_server
    out = tmp_path / "run"
    cfg = BenchConfig(base_url=server.url, dataset_name="mixed", num_prompts=12, request_rate=30.0,
                      random_input_len=24, random_output_len=12, ignore_eos=True, result_dir=str(out),
                      goodput=("ttft:2000", "tpot:500"), save_workload=str(tmp_path / "w.yaml"))
    summary = run_bench(cfg)["summary"]
    for name in ("result.json", "summary.md", "report.html", "latency_cdf.png", "throughput_queue.png",
                 "token_timeline.png", "requests.jsonl"):
        assert (out / name).stat().st_size > 0, name
    result = json.loads((out / "result.json").read_text())
    assert result["completed"] == 12 and result["failed"] == 0
    for key in ("total_output_tokens", "mean_ttft_ms", "p99_itl_ms", "output_throughput", "request_goodput",
                "median_tpot_ms", "p99_e2el_ms", "p99_stall_ms"):
        assert key in result, key
    assert result["model"] == "tiny" and result["server_config"]["config"]["engine"]["max_num_batched_tokens"] == 64
    assert set(result["per_class"]) == {"chat", "summarise"}
    assert summary["total_output_tokens"] == sum(r["output_tokens"] for r in map(
        json.loads, (out / "requests.jsonl").read_text().splitlines()))
    assert "server_metrics" in result and "running" in result["server_metrics"]
    assert "itl_target" in result["server_metrics"]  # the default ITL target's gauge, scraped
    assert "<img src=\"data:image/png;base64," in (out / "report.html").read_text()
    assert Workload.load(tmp_path / "w.yaml").dataset == "mixed"


def test_sweep_and_inprocess(tandem_server, tmp_path):
    server, model_dir = tandem_server
    out = tmp_path / "sweep"
    cfg = BenchConfig(base_url=server.url, num_prompts=6, random_input_len=16, random_output_len=8,
                      ignore_eos=True, result_dir=str(out), sweep=True, sweep_max_concurrency=4)
    result = run_bench(cfg)["summary"]
    levels = [r["concurrency"] for r in result["levels"]]
    assert levels[0] == 1 and levels == sorted(levels) and max(levels) <= 4
    for name in ("sweep.json", "sweep.md", "sweep.png", "concurrency_1/result.json"):
        assert (out / name).is_file(), name
    from tandem.model_files import default_model_path
    from tandem.config import EngineConfig, SchedulerConfig
    from tandem.core.step import SIZING_LIMITS
    from tandem.weights.cache import converted_entry

    inproc = tmp_path / "inproc"
    # the tiny model's word-level tokenizer cannot spell real text: cut prompts with Gemma's
    cfg = BenchConfig(backend="inprocess", num_prompts=5, random_input_len=16, random_output_len=6, ignore_eos=True,
                      result_dir=str(inproc), max_concurrency=2,
                      tokenizer=str(converted_entry(default_model_path())))
    res = run_bench(cfg, EngineConfig.from_kwargs(model=str(model_dir), dtype="float32", num_kv_blocks=64))
    assert res["summary"]["completed"] == 5 and res["summary"]["total_output_tokens"] == 30
    # the default ITL target sized every step with running streams (6 tokens each: 5 decode steps
    # per request at least, two at a time), and the report says so
    sized = sum(res["summary"].get(f"steps_sized_{limit}", 0) for limit in SIZING_LIMITS)
    assert sized >= 13 and res["summary"]["median_itl_target_ms"] >= SchedulerConfig().min_target_itl_ms
    assert "steps_sized_itl" in (inproc / "summary.md").read_text()
    assert (inproc / "report.html").is_file()
