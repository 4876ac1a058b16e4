"""The server's lifecycle and connection hygiene: a taken port fails before the model loads,
SIGTERM ends every stream with a final event and [DONE], slow and idle connections are closed,
the connection cap holds, and a client that stops reading has its request aborted."""

from __future__ import annotations

import asyncio
import gc
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tandem.config import EngineConfig, ServerConfig
from tandem.server.routes import create_app
from tandem.server.state import build_state
from tandem.server.streaming import ABORT_EXTENSION
from test_server import Server, metric, metrics, wait_idle
from tiny_models import save_tiny

PEAKS = ("--peak-flops", "1e11", "--peak-memory-bandwidth", "2e10")
SYS_TGKILL = {"x86_64": 234, "aarch64": 131}.get(os.uname().machine)
ABORTED = 'tandem:request_success_total{finished_reason="abort",model_name="tiny"}'
LENGTH = 'tandem:request_success_total{finished_reason="length",model_name="tiny"}'


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("lifecycle-llama")
    save_tiny("llama", d, max_position_embeddings=2048)
    return d


def test_a_taken_port_fails_before_the_model_loads(model_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "tandem.cli", "serve", "--model", str(model_dir), "--port",
                               str(port), *PEAKS], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, done.stderr
    assert f"127.0.0.1:{port}" in done.stderr and "--port" in done.stderr
    assert "loading model" not in done.stderr and "serving" not in done.stderr


def _stream(url: str, body: dict, lines: list[str], started: threading.Event) -> None:
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        for line in r.iter_lines():
            if line:
                lines.append(line)
                started.set()


def test_sigterm_ends_every_stream_and_refuses_newcomers(model_dir):
    s = Server(model_dir, "--shutdown-timeout", "2", "--max-num-seqs", "8", *PEAKS)
    try:
        long_body = {"prompt": "w1 w2", "max_tokens": 2000, "ignore_eos": True}
        streams = [([], threading.Event()) for _ in range(4)]
        threads = [threading.Thread(target=_stream, args=(s.url, long_body, lines, ev)) for lines, ev in streams]
        plain: list[httpx.Response] = []
        threads.append(threading.Thread(target=lambda: plain.append(
            httpx.post(s.url + "/v1/completions", json=long_body, timeout=60))))
        for t in threads:
            t.start()
        assert all(ev.wait(30) for _, ev in streams)
        short: tuple[list[str], threading.Event] = ([], threading.Event())
        threads.append(threading.Thread(target=_stream, args=(
            s.url, {"prompt": "w3", "max_tokens": 20, "ignore_eos": True}, *short)))
        threads[-1].start()
        assert short[1].wait(30)
        signalled = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        late = httpx.post(s.url + "/v1/completions", json={"prompt": "w1", "max_tokens": 2}, timeout=10)
        assert late.status_code == 503 and late.headers["connection"] == "close"
        assert late.json()["error"]["code"] == "server_shutting_down"
        for t in threads:
            t.join(30)
        assert s.proc.wait(timeout=20) == 0
        assert time.monotonic() - signalled < 2 + 5
    finally:
        if s.proc.poll() is None:
            s.proc.kill()
    for lines, _ in streams:  # cut by the timeout: a final error event, then [DONE]
        assert lines[-1] == "data: [DONE]"
        assert json.loads(lines[-2][len("data: "):])["error"]["code"] == "server_shutting_down"
    assert short[0][-1] == "data: [DONE]"  # finished within the grace period, normally
    assert json.loads(short[0][-2][len("data: "):])["choices"][0]["finish_reason"] == "length"
    assert plain[0].status_code == 503 and plain[0].json()["error"]["code"] == "server_shutting_down"
    log = "".join(s.log)
    assert "Traceback" not in log and "CancelledError" not in log, log


def _raw(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    return sock


@pytest.mark.skipif(not sys.platform.startswith("linux") or SYS_TGKILL is None,
                    reason="tgkill (a signal to one thread) is Linux's; its number known for x86_64 and aarch64")
def test_a_signal_routed_to_another_thread_still_shuts_the_idle_server_down(model_dir):
    """The kernel may hand a process's SIGINT to any of its threads; Python runs the handler on the
    main thread (the engine loop's) only once that thread wakes, which an idle loop must do."""
    import ctypes

    s = Server(model_dir, *PEAKS)
    pid = s.proc.pid
    others = sorted(int(t) for t in os.listdir(f"/proc/{pid}/task") if int(t) != pid)
    assert others  # the HTTP thread at least
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.syscall(SYS_TGKILL, pid, others[0], signal.SIGINT) == 0, ctypes.get_errno()
    try:
        assert s.proc.wait(timeout=20) == 0
    finally:
        s.stop()


def _read_all(sock: socket.socket) -> bytes:
    out = b""
    while chunk := sock.recv(65536):
        out += chunk
    return out


def test_slow_headers_idle_connections_and_the_cap(model_dir):
    s = Server(model_dir, "--header-timeout", "1.5", "--keep-alive-timeout", "1", "--max-connections", "3", *PEAKS)
    try:
        idle, slow, third = _raw(s.port), _raw(s.port), _raw(s.port)
        opened = time.monotonic()
        slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # and never the rest
        over = _raw(s.port)
        over.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        refused = _read_all(over)
        assert refused.startswith(b"HTTP/1.1 503") and b"connection: close" in refused.lower()
        assert json.loads(refused.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "too_many_connections"
        assert _read_all(idle) == b""  # closed without a word: it never began a request
        answer = _read_all(slow)
        assert answer.startswith(b"HTTP/1.1 408") and b'"request_timeout"' in answer
        assert _read_all(third) == b""
        assert 1.0 < time.monotonic() - opened < 6
        with httpx.Client(base_url=s.url, timeout=10) as client:  # room again; keep-alive still works
            assert client.get("/health").status_code == 200
            assert client.get("/health").status_code == 200
        for sock in (idle, slow, third, over):
            sock.close()
    finally:
        assert s.stop() == 0


def test_a_client_that_never_reads_its_stream_is_aborted(model_dir):
    s = Server(model_dir, "--stream-write-timeout", "1", *PEAKS)
    try:
        m = wait_idle(s)
        before = {k: m.get(k, 0) for k in (ABORTED, LENGTH)}
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # the client's window stays small
        sock.connect(("127.0.0.1", s.port))
        body = json.dumps({"prompt": "w1 w2", "max_tokens": 2000, "n": 16, "logprobs": 20, "stream": True,
                           "ignore_eos": True}).encode()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        deadline = time.monotonic() + 60
        while sum(metrics(s).get(k, 0) - v for k, v in before.items()) < 16 and time.monotonic() < deadline:
            time.sleep(0.2)
        m = wait_idle(s)
        # The engine does not wait for the client, so on a fast machine the choices scheduled first
        # may reach their 2000 tokens within the second before the stall is seen; the rest are aborted.
        assert m[ABORTED] > before[ABORTED]
        assert m[ABORTED] - before[ABORTED] + m.get(LENGTH, 0) - before[LENGTH] == 16
        assert metric(m, "tandem:kv_cache_usage_perc") == 0
        sock.close()
    finally:
        assert s.stop() == 0


def test_a_stalled_send_aborts_the_request_and_frees_its_blocks(tmp_path):
    save_tiny("llama", tmp_path)
    config = EngineConfig.from_kwargs(model=str(tmp_path), dtype="float32", num_kv_blocks=64, block_size=4)
    state = build_state(config, ServerConfig(peak_flops=1e11, peak_memory_bandwidth=1e10, stream_write_timeout=0.3))
    app = create_app(state)
    body = json.dumps({"prompt": "w1", "max_tokens": 200, "stream": True, "ignore_eos": True}).encode()
    sent: list[dict] = []
    dropped = asyncio.Event()

    delivered = []

    async def receive():
        if not delivered:
            delivered.append(True)
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()  # the client says nothing more

    async def send(message):
        sent.append(message)
        if len(sent) > 3:  # the client stops reading
            await asyncio.Event().wait()

    async def scenario():
        async with app.router.lifespan_context(app):
            scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
                     "method": "POST", "path": "/v1/completions", "raw_path": b"/v1/completions",
                     "query_string": b"", "root_path": "", "scheme": "http", "client": ("127.0.0.1", 1),
                     "server": ("127.0.0.1", 2), "headers": [(b"content-type", b"application/json")],
                     "extensions": {ABORT_EXTENSION: dropped.set}}
            await asyncio.wait_for(app(scope, receive, send), 10)
            assert dropped.is_set()
            for _ in range(200):
                if not state.engine.has_unfinished_requests():
                    break
                await asyncio.sleep(0.02)
            assert not state.engine.has_unfinished_requests() and state.engine.allocator.all_free()

    asyncio.run(scenario())
    assert sent[0]["status"] == 200 and len(sent) == 4


def test_a_failed_engine_loop_ends_open_streams_and_the_server(tmp_path):
    """A bug in the engine loop outside a step (rigged here) must not leave an HTTP server up
    whose requests wait forever: the open stream ends with an error event and [DONE], and
    serve() raises with the HTTP thread gone. (And serve froze start-up's objects out of the
    garbage collector's full passes.)"""
    from tandem.server.serve import bind, serve

    save_tiny("llama", tmp_path)
    config = EngineConfig.from_kwargs(model=str(tmp_path), dtype="float32", num_kv_blocks=64, block_size=4)
    state = build_state(config, ServerConfig(peak_flops=1e11, peak_memory_bandwidth=1e10))
    engine = state.engine
    real = engine.has_unfinished_requests
    steps = {"n": 0}

    def rigged() -> bool:
        busy = real()
        if busy:
            steps["n"] += 1
            if steps["n"] > 5:  # a few tokens out, then the loop itself fails
                raise RuntimeError("rigged loop failure")
        return busy

    engine.has_unfinished_requests = rigged
    sock = bind("127.0.0.1", 0)
    port = sock.getsockname()[1]
    lines: list[str] = []
    after: list[int] = []

    def client() -> None:
        for _ in range(100):  # until the server listens
            try:
                httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
                break
            except httpx.TransportError:
                time.sleep(0.1)
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", timeout=30,
                          json={"prompt": "w1 w2", "max_tokens": 100, "ignore_eos": True, "stream": True}) as r:
            lines.extend(line for line in r.iter_lines() if line)
        try:
            after.append(httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=5,
                                    json={"prompt": "w1", "max_tokens": 2}).status_code)
        except httpx.TransportError:
            after.append(0)  # the server is gone: refused, not waiting

    t = threading.Thread(target=client)
    t.start()
    started = time.monotonic()
    gc.unfreeze()
    try:
        with pytest.raises(RuntimeError, match="rigged loop failure"):
            serve(create_app(state), state, sock, "warning")
        # start-up's objects went to the permanent generation: a full collection skips them
        assert gc.get_freeze_count() > 10_000
    finally:
        engine.has_unfinished_requests = real
        gc.unfreeze()
    t.join(30)
    assert not t.is_alive() and time.monotonic() - started < 30
    assert not any(th.name == "tandem-http" and th.is_alive() for th in threading.enumerate())
    assert lines[-1] == "data: [DONE]", lines[-3:]
    error = json.loads(lines[-2][len("data: "):])["error"]
    assert error["code"] == "server_shutting_down" and "rigged loop failure" in error["message"]
    assert after and after[0] in (0, 503)
