"""The replicated server's HTTP ingress: a Ray Serve deployment with a FastAPI app that forwards
every request to an engine replica through a deployment handle, whose request router
(``ray_router.py``) picks the replica.

The ingress answers only what concerns all replicas: ``/metrics`` (every replica's series with a
``replica`` label, and the router's), ``/health`` (each replica's, summed up) and ``/replicas``
(what the router knows of each). Everything else is the replica's app answering
(``forward.py``): a body is read here only to weigh it (``route_info.py``), with the same size
and time limits the replica applies.

A replica that dies ends its requests here, not in a hang: a stream that had started gets a final
error event and ``data: [DONE]``, any other request a 503; Ray Serve starts a replacement and new
requests go to the replicas alive.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import hmac
import json
import logging
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from tandem.config import EngineConfig, ServerConfig
from tandem.core.prefix_cache import PrefixHasher
from tandem.scale.forward import Forwarded, Pinned, ResponseStart
from tandem.scale.route_info import GENERATE_PATHS, route_request
from tandem.server.json_body import read_body
from tandem.server.protocol import APIError
from tandem.server.routes import watch_disconnect
from tandem.server.streaming import GuardedStreamingResponse

log = logging.getLogger(__name__)

PINNED_TIMEOUT_S = 5.0
"""How long /metrics and /health wait for one replica before leaving it out."""
ROUTER_KEY = "tandem"
HOP_HEADERS = {b"content-length", b"transfer-encoding", b"connection"}


class Ingress:
    def __init__(self, engine, engine_config: EngineConfig, server_config: ServerConfig) -> None:
        from tandem.model_files import load_tokenizer
        from tandem.server.chat import ChatFormatter
        from tandem.server.offload import Offload

        self.engine = engine
        self.config = server_config
        tokenizer, spec = load_tokenizer(engine_config.model)
        self.tokenizer = tokenizer
        self.chat = ChatFormatter(tokenizer, spec.family)
        self.offload = Offload(server_config.tokenizer_threads)
        key = server_config.resolved_api_key()
        self.expected_auth = f"Bearer {key}".encode() if key else None
        self.hasher: PrefixHasher | None = None
        self._info: dict[str, Any] | None = None
        self._info_lock = asyncio.Lock()

    def __serve_build_asgi_app__(self):
        return build_app(self)

    # --- helpers ---------------------------------------------------------------------------------
    def router(self):
        from tandem.scale.router_directory import ROUTERS
        return ROUTERS.get(ROUTER_KEY)

    async def info(self) -> dict[str, Any] | None:
        """A replica's description (block size, cache namespace), asked once."""
        async with self._info_lock:
            if self._info is None:
                try:
                    self._info = await self.call(None, "info", 60)
                except Exception as exc:
                    log.warning("no replica described itself: %s", exc)
                    return None
                ns = self._info.get("cache_namespace")
                if ns is not None:
                    self.hasher = PrefixHasher(self._info["block_size"], ns)
            return self._info

    async def call(self, pin: Pinned | None, what: str, timeout: float) -> Any:
        """A call of the ingress's own, not the HTTP request's: Ray gives a call made while handling
        a request that request's id, and calls sharing an id can be handed each other's replica."""
        async def run():
            return await self.engine.call.remote(pin, what)

        task = asyncio.get_running_loop().create_task(run(), context=contextvars.Context())
        return await asyncio.wait_for(task, timeout)

    async def pinned(self, replica: str, what: str) -> Any:
        return await self.call(Pinned(replica), what, PINNED_TIMEOUT_S)

    async def each_replica(self, what: str) -> dict[str, Any]:
        """``what`` from every replica the router knows; a replica that fails or times out maps to
        its exception."""
        await self.info()  # makes sure the handle's router exists
        router = self.router()
        names = router.replica_names() if router is not None else []
        results = await asyncio.gather(*(self.pinned(n, what) for n in names), return_exceptions=True)
        return dict(zip(names, results))

    def authorized(self, request: Request) -> bool:
        if self.expected_auth is None:
            return True
        return hmac.compare_digest(request.headers.get("authorization", "").encode(), self.expected_auth)


def build_app(ing: Ingress) -> FastAPI:
    app = FastAPI(title="tandem (replicated)", docs_url=None, redoc_url=None, openapi_url=None)
    settings = ing.config

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.get("/metrics")
    async def metrics():
        from prometheus_client import generate_latest

        from tandem.scale.metrics_merge import merge_replica_metrics
        from tandem.scale.router_directory import REGISTRY

        # None: a replica that did not answer, counted in tandem:replica_metrics_errors
        texts = {n: None if isinstance(r, BaseException) else r
                 for n, r in (await ing.each_replica("metrics")).items()}
        body = merge_replica_metrics(texts, generate_latest(REGISTRY).decode())
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/health")
    async def health():
        replies = await ing.each_replica("info")
        alive = [n for n, r in replies.items() if not isinstance(r, BaseException)]
        body = {"status": "ok" if alive and len(alive) == len(replies) else "degraded" if alive else "dead",
                "replicas": len(replies), "replicas_alive": len(alive)}
        return JSONResponse(body, status_code=200 if alive else 503)

    @app.get("/replicas")
    async def replicas():
        replies = await ing.each_replica("info")
        router = ing.router()
        views = {v["replica"]: v for v in (router.snapshot() if router is not None else [])}
        out = []
        for name, info in replies.items():
            entry = {"replica": name, **views.get(name, {})}
            if isinstance(info, BaseException):
                entry["error"] = f"{type(info).__name__}: {info}"
            else:
                entry.update({k: info[k] for k in ("actor_name", "node_id", "started", "num_kv_blocks", "paths")})
            out.append(entry)
        return {"routing": settings.routing, "replicas": out}

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"])
    async def forward(request: Request, path: str):
        body = await read_body(request, settings.max_request_bytes, settings.body_timeout)
        route = None
        if request.method == "POST" and request.url.path in GENERATE_PATHS:
            await ing.info()
            if ing.authorized(request):  # an unauthorized body is not worth tokenizing: the replica refuses it
                route = await ing.offload.run(route_request, request.url.path, body, ing.tokenizer, ing.chat,
                                              ing.hasher)
        client = request.client
        fwd = Forwarded(request.method, request.url.path, request.url.query.encode(), list(request.headers.raw), body,
                        (client.host, client.port) if client else None, route)
        return await _relay(ing, request, fwd)

    return app


async def _relay(ing: Ingress, request: Request, fwd: Forwarded) -> Response:
    stream = ing.engine.options(stream=True).forward.remote(fwd)
    try:
        start = await stream.__anext__()
    except Exception as exc:
        stream.cancel()
        return _replica_failed(exc)
    if not isinstance(start, ResponseStart):
        stream.cancel()
        return _replica_failed(RuntimeError(f"the replica answered {type(start).__name__} before a response start"))
    headers = [(k, v) for k, v in start.headers if k.lower() not in HOP_HEADERS]
    content_type = dict((k.lower(), v) for k, v in start.headers).get(b"content-type", b"")
    if content_type.startswith(b"text/event-stream"):
        response = GuardedStreamingResponse(_events(stream), status_code=start.status,
                                            write_timeout=ing.config.stream_write_timeout)
        response.raw_headers = headers
        return response
    collecting = asyncio.ensure_future(_collect(stream))
    watch = asyncio.ensure_future(watch_disconnect(request))
    done, _ = await asyncio.wait({collecting, watch}, return_when=asyncio.FIRST_COMPLETED)
    if collecting not in done:  # the client went away: the replica's app aborts its requests
        collecting.cancel()
        stream.cancel()
        with contextlib.suppress(BaseException):
            await collecting
        return Response(status_code=499)
    watch.cancel()
    try:
        body = collecting.result()
    except Exception as exc:
        return _replica_failed(exc)
    response = Response(body, status_code=start.status)
    response.raw_headers = [*headers, (b"content-length", str(len(body)).encode())]
    return response


async def _events(stream) -> AsyncIterator[bytes]:
    finished = False
    try:
        async for chunk in stream:
            yield chunk
        finished = True
    except Exception as exc:  # the replica died mid-stream
        finished = True
        log.warning("a replica failed mid-stream: %s", exc)
        err = APIError(503, f"the replica serving this request failed: {type(exc).__name__}", code="replica_failed")
        yield b"data: " + json.dumps(err.body()).encode() + b"\n\n"
        yield b"data: [DONE]\n\n"
    finally:
        if not finished:  # the client went away or stopped reading: the replica aborts the request
            stream.cancel()


async def _collect(stream) -> bytes:
    return b"".join([chunk async for chunk in stream])


def _replica_failed(exc: BaseException) -> JSONResponse:
    log.warning("a replica failed before answering: %s", exc)
    err = APIError(503, f"the replica chosen for this request failed before answering ({type(exc).__name__}); "
                   "retry", code="replica_failed", headers={"Retry-After": "1"})
    return JSONResponse(err.body(), status_code=503, headers=err.headers)
