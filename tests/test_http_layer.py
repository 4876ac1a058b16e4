"""The HTTP layer around the routes: an unexpected exception is a 500 in OpenAI's shape that
leaves the keep-alive connection usable, tokenization runs off the event loop, browser-reachable
requests (non-JSON bodies, foreign Host headers) are refused, and the papercuts of /tokenize,
/config, /v1/models, the trace and `tandem bench`'s exit code.

The server runs in this process (uvicorn in a thread, on a free loopback port) so a test can
make a route raise."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import json
import threading
import time

import httpx
import pytest
import uvicorn

from tandem.bench.launch import free_port
from tandem.config import EngineConfig, ServerConfig
from tandem.server import openai_format
from tandem.server.browser import allowed_host_names, host_name, is_json_type
from tandem.server.routes import create_app
from tandem.server.state import build_state
from tiny_models import save_tiny




@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("http-layer")
    save_tiny("llama", d, max_position_embeddings=2048)
    return d


@pytest.fixture(scope="module")
def state(model_dir, tmp_path_factory):
    config = EngineConfig.from_kwargs(model=str(model_dir), dtype="float32", num_kv_blocks=1024, block_size=4)
    trace = tmp_path_factory.mktemp("trace") / "trace.json"
    return build_state(config, ServerConfig(peak_flops=1e11, peak_memory_bandwidth=1e10, max_request_bytes=2 << 20,
                                            trace=str(trace), served_model_name="tiny"))


@pytest.fixture(scope="module")
def url(state):
    port = free_port()
    # as ``serve`` does once start-up is done: a full collection of this test process's heap (every
    # module and test before this one) can otherwise land inside the timed stream below
    gc.freeze()
    server = uvicorn.Server(uvicorn.Config(create_app(state), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started:
        assert time.time() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=30)
    gc.unfreeze()


def _local_port(response: httpx.Response) -> int:
    return response.extensions["network_stream"].get_extra_info("client_addr")[1]


def _assert_error_shape(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    err = response.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


# --- 500s keep the connection --------------------------------------------------------------------------


def test_unexpected_error_is_json_and_keeps_the_connection(url, state, monkeypatch):
    def boom(*args, **kwargs):
        raise RuntimeError("tokenizer exploded")

    with httpx.Client(base_url=url, timeout=30) as client:
        first = client.get("/health")
        monkeypatch.setattr(state.tokenizer, "encode", boom)
        bad = client.post("/tokenize", json={"prompt": "w5 w6"})
        err = _assert_error_shape(bad, 500)
        assert err["type"] == "server_error" and "tokenizer exploded" in err["message"]
        assert bad.headers.get("connection", "").lower() != "close"
        monkeypatch.undo()
        good = client.post("/tokenize", json={"prompt": "w5 w6"})
        assert good.status_code == 200 and good.json()["tokens"] == [1, 5, 6]
        # one pooled connection carried all three: the error did not reset it
        assert _local_port(first) == _local_port(bad) == _local_port(good)


def test_error_mid_stream_ends_the_stream_and_keeps_the_connection(url, monkeypatch):
    real = openai_format._event
    calls = {"n": 0}

    def flaky(data):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("formatting failed")
        return real(data)

    monkeypatch.setattr(openai_format, "_event", flaky)
    body = {"prompt": "w5 w6", "max_tokens": 8, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=url, timeout=30) as client:
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 200
        events = [line.removeprefix("data: ") for line in r.text.split("\n\n") if line]
        assert events[-1] == "[DONE]"
        assert "formatting failed" in json.loads(events[-2])["error"]["message"]
        monkeypatch.undo()
        after = client.post("/v1/completions", json={**body, "stream": False})
        assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 8
        assert _local_port(r) == _local_port(after)


# --- tokenization off the event loop ------------------------------------------------------------------


def test_large_tokenize_calls_do_not_stall_a_stream(url):
    big = {"prompt": "w5 w6 w7 " * 110_000}  # ~1 MiB, ~330k tokens
    body = {"prompt": "w5", "max_tokens": 1800, "ignore_eos": True, "stream": True}
    baseline_gap = loaded_gap = 0.0
    load_done = threading.Event()
    statuses: list[int] = []

    def tokenize_load():
        with httpx.Client(base_url=url, timeout=60) as c:
            statuses.append(c.post("/tokenize", json=big).status_code)

    with httpx.Client(base_url=url, timeout=60) as client, client.stream("POST", "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        next(lines)
        start = last = time.perf_counter()
        workers: list[threading.Thread] = []
        for line in lines:
            now = time.perf_counter()
            gap, last = now - last, now
            if not workers:
                baseline_gap = max(baseline_gap, gap)
                if now - start > 0.5:
                    workers = [threading.Thread(target=tokenize_load) for _ in range(8)]
                    for w in workers:
                        w.start()
                    threading.Thread(target=lambda: ([w.join() for w in workers], load_done.set())).start()
            else:
                loaded_gap = max(loaded_gap, gap)
                if load_done.is_set():
                    break
            if line == "data: [DONE]":
                break
    assert load_done.wait(60) and statuses == [200] * 8
    # tokenized on the event loop, eight of these stall every stream for seconds
    assert loaded_gap < baseline_gap + 1.0, (baseline_gap, loaded_gap)


# --- browser exposure ------------------------------------------------------------------------------------


@pytest.mark.parametrize("content_type, status", [
    ("text/plain", 415), ("application/x-www-form-urlencoded", 415), ("multipart/form-data; boundary=x", 415),
    ("application/json", 200), ("application/json; charset=utf-8", 200), ("Application/JSON", 200),
    ("application/merge-patch+json", 200), (None, 200),
])
def test_post_bodies_must_be_json(url, content_type, status):
    headers = {"content-type": content_type} if content_type else {}
    with httpx.Client(base_url=url, timeout=30) as client:
        r = client.post("/tokenize", content=b'{"prompt": "w5"}', headers=headers)
        assert r.request.headers.get("content-type") == content_type
    if status == 415:
        err = _assert_error_shape(r, 415)
        assert err["param"] == "Content-Type" and err["code"] == "unsupported_media_type"
    else:
        assert r.status_code == 200, r.text


@pytest.mark.parametrize("host, status", [
    ("localhost", 200), ("localhost:8000", 200), ("127.0.0.1:1", 200), ("[::1]:8000", 200), ("LOCALHOST", 200),
    ("evil.example", 400), ("evil.example:8000", 400), ("127.0.0.1.evil.example", 400),
])
def test_loopback_server_checks_host(url, host, status):
    with httpx.Client(base_url=url, timeout=30) as client:
        r = client.get("/v1/models", headers={"host": host})
    if status == 400:
        err = _assert_error_shape(r, 400)
        assert err["param"] == "Host" and err["code"] == "invalid_host"
    else:
        assert r.status_code == 200


def test_allowed_hosts_rule():
    assert host_name("Example.COM:80") == "example.com" and host_name("[::1]:9") == "[::1]"
    assert allowed_host_names("127.0.0.1", ()) == {"localhost", "127.0.0.1", "[::1]"}
    assert allowed_host_names("::1", ()) == {"localhost", "127.0.0.1", "[::1]"}
    assert allowed_host_names("0.0.0.0", ()) is None
    assert allowed_host_names("127.0.0.1", ("api.example",)) == {"api.example"}
    assert allowed_host_names("127.0.0.1", ("*",)) is None
    assert is_json_type(b"application/json;charset=UTF-8") and not is_json_type(b"text/json")


def _in_process(state, **changes):
    """An app over a copy of the state with other settings (no lifespan: these routes need no engine loop)."""
    st = dataclasses.replace(state, **changes)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(st)), base_url="http://localhost")


def test_allowed_hosts_and_bind_elsewhere(state):
    async def scenario():
        listed = ServerConfig(**{**dataclasses.asdict(state.config), "allowed_hosts": ("api.example",)})
        async with _in_process(state, config=listed) as c:
            assert (await c.get("/v1/models", headers={"host": "api.example:8000"})).status_code == 200
            assert (await c.get("/v1/models", headers={"host": "localhost"})).status_code == 400
        wide = ServerConfig(**{**dataclasses.asdict(state.config), "host": "0.0.0.0"})
        async with _in_process(state, config=wide) as c:
            assert (await c.get("/v1/models", headers={"host": "anything.example"})).status_code == 200

    asyncio.run(scenario())


def test_tokenize_needs_the_key_when_one_is_set(state):
    async def scenario():
        async with _in_process(state, api_key="k") as c:
            for path, body in (("/tokenize", {"prompt": "w5"}), ("/detokenize", {"tokens": [5]})):
                err = _assert_error_shape(await c.post(path, json=body), 401)
                assert err["code"] == "invalid_api_key"
                assert (await c.post(path, json=body, headers={"Authorization": "Bearer k"})).status_code == 200
            assert (await c.get("/health")).status_code == 200

    asyncio.run(scenario())


# --- papercuts ---------------------------------------------------------------------------------------------


def test_tokenize_add_special_tokens(url):
    with httpx.Client(base_url=url, timeout=30) as c:
        assert c.post("/tokenize", json={"prompt": "w5 w6"}).json()["tokens"] == [1, 5, 6]
        r = c.post("/tokenize", json={"prompt": "w5 w6", "add_special_tokens": False}).json()
        assert r["tokens"] == [5, 6] and r["count"] == 2
        assert c.post("/detokenize", json={"tokens": [5, 6]}).json()["prompt"] == "w5 w6"


def test_config_reports_resolved_values(state):
    async def scenario():
        asked = EngineConfig.from_kwargs(model=state.engine_config.model.model, dtype="auto", quantization="auto",
                                         num_kv_blocks=None, block_size=4)
        async with _in_process(state, engine_config=asked) as c:
            body = (await c.get("/config")).json()
        engine, requested = body["engine"], body["requested"]
        assert engine["dtype"] == state.paths["dtype"] == "float32" and requested["dtype"] == "auto"
        assert engine["quantization"] == state.paths["quantization"] and requested["quantization"] == "auto"
        assert engine["device"] == "cpu" and requested["device"] == "auto"
        assert engine["num_kv_blocks"] == 1024 and requested["num_kv_blocks"] is None
        assert engine["max_model_len"] == state.engine.max_model_len and "block_size" not in requested

    asyncio.run(scenario())


def test_models_has_root_and_parent(url):
    entry = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]
    assert entry["id"] == entry["root"] == "tiny" and entry["parent"] is None


def test_trace_tracks_are_response_ids_and_spans_nest(url, state):
    with httpx.Client(base_url=url, timeout=30) as c:
        one = c.post("/v1/completions", json={"prompt": "w5 w6", "max_tokens": 4, "ignore_eos": True}).json()
        two = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "w5"}], "n": 2,
                                                   "max_tokens": 3, "ignore_eos": True}).json()
    path = state.tracer.write()
    events = json.loads(path.read_text())["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"
             and e["pid"] == 2}
    assert one["id"].startswith("cmpl-") and two["id"].startswith("chatcmpl-")
    assert one["id"] in names.values()
    assert {f"{two['id']}-0", f"{two['id']}-1"} <= set(names.values())
    tid = next(t for t, n in names.items() if n == one["id"])
    spans = [e for e in events if e["ph"] == "X" and e["pid"] == 2 and e["tid"] == tid]
    assert [s["name"] for s in spans][:2] == ["request", "queued"] and len(spans) == 2 + 4
    _assert_nested(spans)
    for t in names:  # every request track, and the step track
        _assert_nested([e for e in events if e["ph"] == "X" and e["pid"] == 2 and e["tid"] == t])
    _assert_nested([e for e in events if e["ph"] == "X" and e["pid"] == 1])


def _assert_nested(spans: list[dict]) -> None:
    """Sorted as written, each span lies inside every open one or after it (Perfetto's rule)."""
    open_ends: list[float] = []
    for s in spans:
        while open_ends and s["ts"] >= open_ends[-1]:
            open_ends.pop()
        end = s["ts"] + s["dur"]
        assert not open_ends or end <= open_ends[-1] + 1e-6, (s, open_ends)
        open_ends.append(end)


def test_bench_exits_nonzero_when_every_request_fails(url, tmp_path, capsys):
    from tandem.cli import main

    code = main(["bench", "--base-url", url, "--model", "no-such-model", "--num-prompts", "3",
                 "--random-input-len", "8", "--random-output-len", "4", "--result-dir", str(tmp_path / "run")])
    assert code == 1
    err = capsys.readouterr().err
    assert "every one of the 3 requests failed" in err and "no-such-model" in err
    assert (tmp_path / "run" / "result.json").is_file()


def test_a_trickling_body_gets_408_and_its_connection_closed(tmp_path):
    import socket

    from server_helpers import ThreadedServer, tiny_state

    s = ThreadedServer(tiny_state(tmp_path, body_timeout=0.5))
    try:
        sock = socket.create_connection(("127.0.0.1", s.port), timeout=10)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"prompt\": ")  # and the other 89 bytes never
        started = time.monotonic()
        answer = b""
        while chunk := sock.recv(65536):  # ends when the server closes the connection
            answer += chunk
        assert answer.startswith(b"HTTP/1.1 408") and b'"request_timeout"' in answer, answer[:300]
        assert b"connection: close" in answer.lower()
        assert 0.4 < time.monotonic() - started < 5
        sock.close()
        assert httpx.get(s.url + "/health", timeout=10).json()["status"] == "ok"
    finally:
        s.stop()
