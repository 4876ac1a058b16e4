"""The server's lifecycle: bind the port before the model loads, serve, and shut down gracefully.

``bind`` reserves the port first, so a taken port fails in a second instead of after the model
loaded. On the first SIGTERM or SIGINT the server keeps listening but answers every new request
with 503 and ``Connection: close`` (the ``Gate``), refuses whatever waits for admission, and
gives the running requests ``shutdown_timeout`` seconds to finish. Then every request still
open is ended: a stream with a final error event and ``data: [DONE]``, a non-streaming request
with a JSON 503. Only then does uvicorn close the connections and the engine thread stop, so no
task is cancelled mid-response. A second signal ends the running requests at once; a third
leaves without waiting for the connections.

uvicorn runs in a thread of its own and the engine loop on the main thread (why: see
``async_engine.py``); the signal handlers are installed on the main thread, where Python runs
them, and hand the signal to the server's event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
import socket
import sys
import threading
import time
from typing import Callable

import uvicorn

from tandem.config import ServerConfig
from tandem.server.async_engine import IDLE_WAKE_S, AsyncEngine
from tandem.server.connections import ConnectionLimits, json_error, protocol_factory

log = logging.getLogger(__name__)

POLL_S = 0.05
FLUSH_GRACE_S = 1.0
"""After the open requests were ended, how long their last bytes get beyond a stalled write."""
CLOSE_GRACE_S = 2
"""uvicorn's own wait for connections to close, once every response is done."""


class PortInUse(Exception):
    pass


def bind(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` (listening starts when serving does)."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as exc:
        raise PortInUse(f"host: cannot listen on {host!r}: {exc.strerror}") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart need not wait out TIME_WAIT
    try:
        sock.bind(addr)
    except OSError as exc:
        sock.close()
        raise PortInUse(f"port: cannot listen on {host}:{port}: {exc.strerror}; is another server running "
                        f"there? Pick another with --port") from None
    sock.set_inheritable(True)
    return sock


class Gate:
    """ASGI middleware: counts the requests in flight and, once ``closing``, refuses new ones
    with 503 and asks every response still to start to close its connection."""

    def __init__(self, app) -> None:
        self.app = app
        self.active = 0
        self.closing = False

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.closing:
            headers, body = json_error(503, "the server is shutting down", "server_shutting_down")
            await send({"type": "http.response.start", "status": 503, "headers": headers})
            await send({"type": "http.response.body", "body": body, "more_body": False})
            return

        async def closing_send(message) -> None:
            if self.closing and message["type"] == "http.response.start":
                headers = [h for h in message.get("headers", []) if h[0].lower() != b"connection"]
                message = {**message, "headers": [*headers, (b"connection", b"close")]}
            await send(message)

        self.active += 1
        try:
            await self.app(scope, receive, closing_send)
        finally:
            self.active -= 1


class TandemServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, gate: Gate, engine: AsyncEngine, settings: ServerConfig,
                 on_started: Callable[[], None] | None = None) -> None:
        super().__init__(config)
        self.gate = gate
        self.engine = engine
        self.settings = settings
        self.on_started = on_started
        self.signals = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._end_now: asyncio.Event | None = None
        self._draining: asyncio.Future | None = None

    async def startup(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        self._end_now = asyncio.Event()
        await super().startup(sockets=sockets)
        if self.started and self.on_started is not None:
            self.on_started()

    @contextlib.contextmanager
    def capture_signals(self):
        # uvicorn's own version re-raises the signal after shutting down, which would make the exit
        # status the signal's instead of 0; and it only works on the main thread, which runs the
        # engine here. ``serve`` installs the handlers there.
        yield

    def handle_exit(self, sig: int, frame) -> None:
        self.signals += 1
        if self._loop is None:  # not serving yet: nothing to drain
            self.should_exit = True
        elif self.signals == 1:
            self._loop.call_soon_threadsafe(self._start_drain)
        elif self.signals == 2:
            self._loop.call_soon_threadsafe(self._end_now.set)
        else:
            self.force_exit = True

    def _start_drain(self) -> None:
        self._draining = asyncio.ensure_future(self.drain())

    async def drain(self) -> None:
        gate, engine, timeout = self.gate, self.engine, self.settings.shutdown_timeout
        gate.closing = True
        engine.begin_shutdown()
        if gate.active:
            print(f"tandem: shutting down: {gate.active} open request(s) have {timeout:g} s to finish "
                  "(signal again to end them now)", file=sys.stderr, flush=True)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._until(lambda: gate.active == 0 or self._end_now.is_set()), timeout)
        if gate.active:
            engine.end_all()
            grace = self.settings.stream_write_timeout + FLUSH_GRACE_S
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._until(lambda: gate.active == 0), grace)
        self.should_exit = True

    @staticmethod
    async def _until(done: Callable[[], bool]) -> None:
        while not done():
            await asyncio.sleep(POLL_S)


def serve(app, state, sock: socket.socket, log_level: str, on_started: Callable[[], None] | None = None) -> None:
    """Serve ``app`` (built by ``create_app(state)``) on the bound ``sock`` until a signal."""
    settings: ServerConfig = state.config
    gate = Gate(app)
    # the plain asyncio loop, not uvloop where it is installed (Ray Serve brings it): under uvloop
    # the server was seen not to exit on SIGTERM after a streamed request (the drain a signal hands
    # to the loop with call_soon_threadsafe did not run)
    config = uvicorn.Config(
        gate, log_level=log_level, lifespan="on", loop="asyncio",
        http=protocol_factory(ConnectionLimits(settings.header_timeout, settings.max_connections)),
        timeout_keep_alive=settings.keep_alive_timeout,  # type: ignore[arg-type]  # a float works
        timeout_graceful_shutdown=CLOSE_GRACE_S,
    )
    engine = state.async_engine
    server = TandemServer(config, gate, engine, settings, on_started)
    engine.run_on_caller()

    def http() -> None:
        try:
            server.run(sockets=[sock])
        finally:
            engine.stop()  # the lifespan stops it too, unless start-up failed before it ran

    # What start-up built (the model, tokenizer, app: ~250k objects) goes to the permanent
    # generation, so a full collection no longer walks it: one took ~110 ms on a 2-core Zen 3 and,
    # landing inside a step, stretched every running stream's gap by as much.
    gc.freeze()
    started = time.monotonic()
    previous = {sig: signal.signal(sig, server.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
    thread = threading.Thread(target=http, name="tandem-http")
    try:
        thread.start()
        try:
            engine.run()  # returns once the server has shut down; raises if its loop failed
        finally:
            server.should_exit = True  # no engine, no server: the HTTP thread must not serve on
            while thread.is_alive():  # timed, so that a further signal's handler still runs here
                thread.join(IDLE_WAKE_S)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    log.info("served for %.0f s", time.monotonic() - started)
