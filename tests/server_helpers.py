"""What the hostile-input, fuzz and overload tests share: a tiny-model server state, the app
driven in-process on a loop of its own (so a synchronous test or hypothesis can call it), a
real uvicorn on a free loopback port where sockets matter, and the checks every answer must
pass (the OpenAI error shape; an engine that is healthy and holds no KV blocks)."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from tandem.config import EngineConfig, ServerConfig
from tandem.server.routes import create_app
from tandem.server.state import ServerState, build_state
from tiny_models import save_tiny

# the Host a client of a loopback server sends; a foreign one is refused (DNS rebinding)
BASE_URL = "http://127.0.0.1:8000"
ERROR_KEYS = {"message", "type", "param", "code"}


def tiny_state(directory: Path, *, num_kv_blocks: int = 256, max_num_seqs: int = 4, **server: Any) -> ServerState:
    """A tiny llama (vocab 384, 512 positions) behind a ServerState; peaks are given so nothing
    is measured at start-up."""
    save_tiny("llama", directory)
    config = EngineConfig.from_kwargs(model=str(directory), dtype="float32", num_kv_blocks=num_kv_blocks,
                                      block_size=4, max_num_seqs=max_num_seqs)
    server.setdefault("peak_flops", 1e11)
    server.setdefault("peak_memory_bandwidth", 1e10)
    return build_state(config, ServerConfig(**server))


def assert_error(r: httpx.Response, status: int | None = None) -> dict:
    """The body is OpenAI's error shape; returns the inner object."""
    if status is not None:
        assert r.status_code == status, (r.status_code, r.text[:500])
    assert r.headers.get("content-type", "").startswith("application/json"), r.headers
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == ERROR_KEYS, err
    assert isinstance(err["message"], str) and err["message"], err
    assert isinstance(err["type"], str) and err["type"], err
    assert err["param"] is None or isinstance(err["param"], str), err
    return err


def engine_idle(state: ServerState, timeout: float = 10.0) -> bool:
    """Whether the engine settles with nothing running or waiting and every KV block free (a
    finished request's blocks are freed in the loop thread, just after its answer went out)."""
    deadline = time.monotonic() + timeout
    engine = state.engine
    while True:
        if (not engine.has_unfinished_requests() and state.async_engine.num_waiting() == 0
                and engine.allocator.all_free()):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)


class InProcessApp:
    """``create_app(state)`` with its lifespan entered once, on an event loop in a thread of its
    own, reached through ``httpx.ASGITransport``: ``call(method, path, ...)`` works from plain
    synchronous code (a parametrized row, a hypothesis example)."""

    def __init__(self, state: ServerState, base_url: str = BASE_URL, timeout: float = 60.0) -> None:
        self.state = state
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="test-app-loop", daemon=True)
        self._thread.start()
        self.app = create_app(state)
        self._lifespan = self.app.router.lifespan_context(self.app)
        self._run(self._lifespan.__aenter__())
        self.client = self._run(self._client(base_url, timeout))

    async def _client(self, base_url: str, timeout: float) -> httpx.AsyncClient:
        return httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app, raise_app_exceptions=False), base_url=base_url, timeout=timeout)

    def _run(self, coro, timeout: float = 120.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def call(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        return self._run(self.client.request(method, path, **kwargs))

    def gather(self, *requests: tuple[str, str, dict]) -> list[httpx.Response]:
        """Several requests at once (so they share engine steps)."""
        async def go():
            return await asyncio.gather(*(self.client.request(m, p, **kw) for m, p, kw in requests))
        return self._run(go())

    def close(self) -> None:
        try:
            self._run(self.client.aclose())
            self._run(self._lifespan.__aexit__(None, None, None))
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)
            self.loop.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ThreadedServer:
    """The app behind a real uvicorn on a free loopback port, in a thread of this process (so a
    test can look at the engine directly while clients use real sockets)."""

    def __init__(self, state: ServerState, **uvicorn_options: Any) -> None:
        import uvicorn

        self.state = state
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(create_app(state), host="127.0.0.1", port=self.port, log_level="warning",
                                lifespan="on", **uvicorn_options)
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self.server.run, name="test-uvicorn", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(30)
