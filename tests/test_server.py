"""A real `tandem serve` process on a free loopback port, driven by the official openai client
and by raw HTTP for the error cases."""

from __future__ import annotations

import json
import re
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from tandem.bench.launch import ServerProcess, free_port
from tiny_models import save_tiny

API_KEY = "test-key"
MODEL = "tiny"


class Server(ServerProcess):
    def __init__(self, model_dir: Path, *extra: str) -> None:
        self.port = free_port()
        super().__init__([sys.executable, "-m", "tandem.cli", "serve", "--model", str(model_dir), "--port",
                          str(self.port), "--served-model-name", MODEL, "--dtype", "float32", "--num-kv-blocks",
                          "1024", "--block-size", "4", *extra], f"http://127.0.0.1:{self.port}",
                         startup_timeout=120)

    def stop(self) -> int:
        code = super().stop(timeout=30)[0]
        if code != 0:  # shown with the failing test: why it did not exit cleanly
            print(f"the server exited with {code}; its log ends:\n{self._tail()}")
        return code


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("serve-llama")
    # long enough a context that a stream outlasts the client timeouts below on a fast CPU
    save_tiny("llama", d, max_position_embeddings=2048)
    return d


@pytest.fixture(scope="module")
def server(model_dir):
    s = Server(model_dir, "--api-key", API_KEY, "--max-num-seqs", "3", "--max-waiting", "3",
               "--max-request-bytes", "20000", "--max-model-len", "2048", "--admission-queue", "0",
               "--peak-flops", "1e11",
               "--peak-memory-bandwidth", "2e10")
    yield s
    s.stop()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)


def post(server, path, body=None, raw: bytes | None = None, key=API_KEY, timeout=60):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if raw is not None:
        headers["Content-Type"] = "application/json"
        return httpx.post(server.url + path, content=raw, headers=headers, timeout=timeout)
    return httpx.post(server.url + path, json=body, headers=headers, timeout=timeout)


def metrics(server) -> dict[str, float]:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("tandem:"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def metric(m: dict[str, float], prefix: str) -> float:
    return sum(v for k, v in m.items() if k.startswith(prefix))


def wait_idle(server, timeout=20.0) -> dict[str, float]:
    deadline = time.time() + timeout
    while time.time() < deadline:
        m = metrics(server)
        if metric(m, "tandem:num_requests_running") == 0 and metric(m, "tandem:num_requests_waiting") == 0 \
                and metric(m, "tandem:kv_cache_usage_perc") == 0:
            return m
        time.sleep(0.1)
    raise AssertionError(f"server not idle: { {k: v for k, v in m.items() if 'running' in k or 'waiting' in k or 'kv' in k} }")


# --- the official client ------------------------------------------------------------------------------


def test_completion_and_chat(client):
    r = client.completions.create(model=MODEL, prompt="w5 w6 w7", max_tokens=6, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length" and len(r.choices[0].text.split()) == 6
    assert r.usage.completion_tokens == 6 and r.usage.prompt_tokens == 4
    again = client.completions.create(model=MODEL, prompt="w5 w6 w7", max_tokens=6, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert again.choices[0].text == r.choices[0].text  # greedy is deterministic
    c = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "w9 w10"}],
                                       max_completion_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    assert c.choices[0].message.role == "assistant" and c.usage.completion_tokens == 5
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_streaming_matches_non_streaming(client):
    full = client.completions.create(model=MODEL, prompt="w11 w12", max_tokens=8, temperature=0,
                                     extra_body={"ignore_eos": True})
    chunks = list(client.completions.create(model=MODEL, prompt="w11 w12", max_tokens=8, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert chunks[-1].usage.completion_tokens == 8 and not chunks[-1].choices
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    chat = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "w3"}],
                                               max_tokens=4, stream=True, temperature=0,
                                               extra_body={"ignore_eos": True}))
    assert chat[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chat).count("w") == 4


def test_n_seed_logprobs(client):
    r = client.completions.create(model=MODEL, prompt="w20", max_tokens=5, n=3, temperature=1.0, seed=11,
                                  logprobs=2, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert len({c.text for c in r.choices}) > 1  # different seeds per choice
    r2 = client.completions.create(model=MODEL, prompt="w20", max_tokens=5, n=3, temperature=1.0, seed=11,
                                   logprobs=2, extra_body={"ignore_eos": True})
    assert [c.text for c in r.choices] == [c.text for c in r2.choices]
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 5 and len(lp.top_logprobs[0]) == 2 and all(v <= 0 for v in lp.token_logprobs)
    c = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "w3"}], max_tokens=3,
                                       logprobs=True, top_logprobs=2, temperature=0, extra_body={"ignore_eos": True})
    content = c.choices[0].logprobs.content
    assert len(content) == 3 and len(content[0].top_logprobs) == 2


def test_concurrent_streams_interleave(server, client):
    events: list[tuple[str, float]] = []

    def run(name: str, max_tokens: int) -> None:
        for ch in client.completions.create(model=MODEL, prompt="w7 w8", max_tokens=max_tokens, stream=True,
                                            temperature=0, extra_body={"ignore_eos": True}):
            if ch.choices and ch.choices[0].text:
                events.append((name, time.monotonic()))

    # b starts once a streams; a runs long enough that b joins it mid-stream on any machine
    a = threading.Thread(target=run, args=("a", 600))
    b = threading.Thread(target=run, args=("b", 60))
    a.start()
    deadline = time.monotonic() + 60
    while not events and time.monotonic() < deadline:
        time.sleep(0.001)
    b.start()
    a.join(120)
    b.join(120)
    names = [n for n, _ in events]
    last_a = max(i for i, n in enumerate(names) if n == "a")
    first_b = names.index("b")
    assert first_b < last_a, "b's tokens only arrived after a finished"
    assert names.count("a") == 600 and names.count("b") == 60


def test_disconnect_frees_blocks(server):
    wait_idle(server)
    with httpx.stream("POST", server.url + "/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                      json={"model": MODEL, "prompt": "w1 w2", "max_tokens": 2000, "stream": True,
                            "ignore_eos": True}, timeout=60) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data:") for line in got)
        assert metric(metrics(server), "tandem:kv_cache_usage_perc") > 0
    m = wait_idle(server, timeout=10)
    assert 'tandem:request_success_total{finished_reason="abort",model_name="tiny"}' in m


def test_non_streaming_disconnect_aborts(server):
    key = 'tandem:request_success_total{finished_reason="abort",model_name="tiny"}'
    before = wait_idle(server).get(key, 0)
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
        post(server, "/v1/completions", {"prompt": "w1", "max_tokens": 2000, "ignore_eos": True},
             timeout=httpx.Timeout(60, read=0.3))
    assert wait_idle(server, timeout=10)[key] == before + 1


BAD = [
    ({"prompt": "w1", "max_tokens": "5"}, 400, "max_tokens"),
    ({"prompt": "w1", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "w1", "temperature": -1}, 400, "temperature"),
    ({"prompt": "w1", "top_p": 1.5}, 400, "top_p"),
    ({"prompt": "w1", "top_k": -5}, 400, "top_k"),
    ({"prompt": "w1", "n": 0}, 400, "n"),
    ({"prompt": "w1", "logprobs": 50}, 400, "logprobs"),
    ({"prompt": "w1", "model": "gpt-4"}, 400, "model"),
    ({"prompt": ""}, 400, "prompt"),
    ({"prompt": []}, 400, "prompt"),
    ({"prompt": [1, 99999]}, 400, "prompt"),
    ({"prompt": "w1 " * 2100}, 400, "prompt"),
    ({"prompt": "w1", "max_tokens": 2047}, 400, "max_tokens"),
    ({"prompt": "w1", "stop": 3}, 400, "stop"),
    ({"prompt": "w1", "stream": "yes"}, 400, "stream"),
    ({"max_tokens": 3}, 400, "prompt"),
    ({"prompt": "w1", "presence_penalty": 2.5}, 400, "presence_penalty"),
]


@pytest.mark.parametrize("body, status, param", BAD, ids=[f"{p}-{i}" for i, (_, _, p) in enumerate(BAD)])
def test_bad_completion_requests(server, body, status, param):
    r = post(server, "/v1/completions", body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param and param in err["message"]


BAD_CHAT = [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "alien", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user"}], "max_completion_tokens": -1}, "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": "hello"}, "messages"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
]


@pytest.mark.parametrize("body, param", BAD_CHAT, ids=[p for _, p in BAD_CHAT])
def test_bad_chat_requests(server, body, param):
    r = post(server, "/v1/chat/completions", body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_malformed_bodies(server):
    for raw in (b"{not json", b'{"prompt": "\xff\xfe"}', b"[1, 2]"):
        r = post(server, "/v1/completions", raw=raw)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = post(server, "/v1/completions", {"prompt": "w1 " * 8000})
    assert r.status_code == 413 and "error" in r.json()


def test_auth(server):
    for key in (None, "wrong"):
        r = post(server, "/v1/completions", {"prompt": "w1"}, key=key)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(server.url + "/v1/models", timeout=5).status_code == 401
    assert httpx.get(server.url + "/health", timeout=5).status_code == 200  # not under /v1
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0).completions.create(
            model=MODEL, prompt="w1")


def test_queue_bound_gives_429(server):
    wait_idle(server)
    results: list[tuple[int, str | None, bytes]] = []
    lock = threading.Lock()
    release = threading.Event()

    def fire():
        # a stream long enough to outlast the whole test's sending; once the 429s are in, the
        # admitted streams are closed and the server aborts them (no need to wait for their tokens)
        body = {"prompt": "w4 w5", "max_tokens": 1500, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=180,
                          headers={"Authorization": f"Bearer {API_KEY}"}) as r:
            with lock:
                results.append((r.status_code, r.headers.get("retry-after"),
                                r.read() if r.status_code != 200 else b""))
            if r.status_code == 200:
                release.wait(180)

    def started(n: int) -> list[threading.Thread]:
        threads = [threading.Thread(target=fire) for _ in range(n)]
        for t in threads:
            t.start()
        return threads

    def until(name: str, value: float) -> None:
        deadline = time.time() + 60
        while metric(metrics(server), name) < value:
            assert time.time() < deadline, f"{name} never reached {value}"
            time.sleep(0.02)

    # fill the batch, then the waiting queue, each before the next arrives: a step may take longer
    # than the gap between two requests on a busy machine, so sending all at once would race it
    try:
        threads = started(3)
        until("tandem:num_requests_running", 3)
        threads += started(3)
        until("tandem:num_requests_waiting", 3)
        threads += started(3)
        deadline = time.time() + 60
        while len(results) < 9 and time.time() < deadline:
            time.sleep(0.02)
    finally:
        release.set()
    for t in threads:
        t.join(60)
    codes = sorted(code for code, _, _ in results)
    assert codes == [200] * 6 + [429] * 3, codes  # 3 running + 3 waiting fit
    retry_after, body = next((h, b) for code, h, b in results if code == 429)
    assert int(retry_after) >= 1 and json.loads(body)["error"]["type"] == "rate_limit_error"
    assert 'tandem:request_rejected_total{model_name="tiny",reason="queue_full"}' in metrics(server)
    wait_idle(server)  # the closed streams were aborted: nothing left running or waiting


def test_metrics_count_what_was_sent(server, client):
    before = wait_idle(server)
    sent = []
    for i in range(4):
        r = client.completions.create(model=MODEL, prompt=f"w{30 + i} w40", max_tokens=3 + i, temperature=0,
                                      extra_body={"ignore_eos": True})
        sent.append(r.usage)
    after = wait_idle(server)
    key = 'tandem:request_success_total{finished_reason="length",model_name="tiny"}'
    assert after[key] - before.get(key, 0) == 4
    gen = 'tandem:generation_tokens_total{model_name="tiny"}'
    assert after[gen] - before[gen] == sum(u.completion_tokens for u in sent)
    prompt = 'tandem:prompt_tokens_total{model_name="tiny"}'
    assert after[prompt] - before[prompt] == sum(u.prompt_tokens for u in sent)
    ttft = 'tandem:time_to_first_token_seconds_count{model_name="tiny"}'
    assert after[ttft] - before[ttft] == 4
    itl = 'tandem:inter_token_latency_seconds_count{model_name="tiny"}'
    assert after[itl] - before[itl] == sum(u.completion_tokens - 1 for u in sent)
    assert metric(after, "tandem:model_flops_utilization") > 0
    assert metric(after, "tandem:memory_bandwidth_utilization") > 0
    for name in ("tandem:e2e_request_latency_seconds_count", "tandem:request_queue_time_seconds_count",
                 "tandem:request_time_per_output_token_seconds_count", 'tandem:step_duration_seconds_count',
                 'tandem:step_tokens_count{model_name="tiny",type="prefill"}'):
        assert metric(after, name) > 0, name


def test_tokenize_detokenize_version(server):
    r = post(server, "/tokenize", {"prompt": "w5 w6"})
    assert r.json()["tokens"] == [1, 5, 6] and r.json()["count"] == 3
    assert post(server, "/detokenize", {"tokens": [5, 6]}).json()["prompt"] == "w5 w6"
    assert post(server, "/detokenize", {"tokens": [10 ** 6]}).status_code == 400
    assert httpx.get(server.url + "/version", timeout=5).json()["version"]


def test_trace_file(model_dir, tmp_path):
    trace = tmp_path / "trace.json"
    s = Server(model_dir, "--trace", str(trace), "--max-num-batched-tokens", "8", "--peak-flops", "1e11",
               "--peak-memory-bandwidth", "2e10")
    try:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0)
        # long enough to still be decoding when the long prompt gets in, however fast this machine is
        stream = client.completions.create(model=MODEL, prompt="w4 w5", max_tokens=400, stream=True,
                                           extra_body={"ignore_eos": True})
        next(iter(stream))  # the short request is decoding; now a long prompt arrives
        client.completions.create(model=MODEL, prompt="w3 " * 40, max_tokens=4, extra_body={"ignore_eos": True})
        for _ in stream:
            pass
    finally:
        assert s.stop() == 0
    data = json.loads(trace.read_text())
    events = data["traceEvents"]
    names = {e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "process_name"}
    assert names == {"engine", "requests"}
    steps = [e for e in events if e.get("pid") == 1 and e.get("ph") == "X"]
    assert steps and all(e["dur"] >= 0 for e in steps)
    request_tracks = {e["tid"] for e in events if e.get("pid") == 2 and e.get("ph") == "X"}
    assert len(request_tracks) == 2
    chunks = [e for e in events if e.get("pid") == 2 and e["name"].startswith("prefill")]
    assert len(chunks) >= 5  # the 41-token prompt went in 8-token chunks
    assert any(e["name"] == "queued" for e in events)
    assert any(re.match(r"mixed P\d+ D\d+", e["name"]) for e in steps)
