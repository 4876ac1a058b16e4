"""One engine replica as a Ray Serve deployment: the single-process server's app, built in the
replica's actor, answering forwarded HTTP requests, plus its load report for the router.

The model is loaded, and the engine loop then run, on one thread of the actor's own; the app runs
on the actor's event loop. ``record_routing_stats`` is Ray Serve's hook: it calls it
every ``routing_stats_period`` seconds and hands the result to every router (``ray_router.py``);
no router ever calls a replica to decide a request.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, AsyncIterator

from tandem.config import EngineConfig, ServerConfig
from tandem.core.routing import engine_report
from tandem.scale.asgi_bridge import run_asgi
from tandem.scale.forward import Forwarded, Pinned, ResponseStart

log = logging.getLogger(__name__)


class EngineReplica:
    def __init__(self, engine_config: EngineConfig, server_config: ServerConfig) -> None:
        import ray

        from tandem.server.routes import create_app
        from tandem.server.state import build_state

        built: dict = {}
        ready = threading.Event()

        def engine_thread() -> None:
            # the thread that loads the model runs its steps (see server/async_engine.py: a second
            # thread with its own OpenMP pool made decode steps a third slower)
            try:
                built["state"] = state = build_state(engine_config, server_config)
                built["app"] = create_app(state)
                state.async_engine.run_on_caller()
            except BaseException as exc:  # raised again in the constructor: Ray reports it
                built["error"] = exc
                return
            finally:
                ready.set()
            state.async_engine.run()

        threading.Thread(target=engine_thread, name="tandem-engine", daemon=True).start()
        ready.wait()
        if "error" in built:
            raise built["error"]
        self.state, self.app = built["state"], built["app"]
        self.open: set[str] = set()
        context = ray.get_runtime_context()
        self.actor_name = context.get_actor_name()
        self.node_id = context.get_node_id()
        self.started = time.time()
        self.seq = 0
        log.info("replica %s ready: %s", self.actor_name, self.state.paths_line)

    async def forward(self, fwd: Forwarded) -> AsyncIterator[ResponseStart | bytes]:
        route_id = fwd.route.route_id if fwd.route is not None else None
        if route_id is not None:
            self.open.add(route_id)
        try:
            async for part in run_asgi(self.app, fwd):
                yield part
        finally:
            if route_id is not None:
                self.open.discard(route_id)

    async def call(self, pin: Pinned | None, what: str) -> Any:
        if what == "metrics":
            ae = self.state.async_engine
            return self.state.metrics.render(ae.engine.num_running, ae.num_waiting(), ae.engine.allocator.usage)
        if what == "info":
            return self.info()
        raise ValueError(f"what: unknown call {what!r}")

    def info(self) -> dict[str, Any]:
        engine = self.state.engine
        cache = engine.scheduler.prefix_cache
        return {
            "actor_name": self.actor_name, "node_id": self.node_id, "started": self.started,
            "model": self.state.model_name, "max_model_len": engine.max_model_len,
            "block_size": engine.allocator.block_size, "num_kv_blocks": engine.allocator.num_blocks,
            "cache_namespace": cache.hasher.namespace if cache is not None else None,
            "paths": self.state.paths_line,
        }

    def record_routing_stats(self) -> dict[str, Any]:
        """The replica's ``ReplicaReport`` as plain data, numbered so a router reads each once."""
        ae = self.state.async_engine
        inbox = max(0, ae.num_waiting() - ae.engine.num_waiting)
        self.seq += 1
        return {"seq": self.seq, "time": time.time(), **engine_report(ae.engine, list(self.open), inbox).to_stats()}

    def __del__(self) -> None:
        state = getattr(self, "state", None)
        if state is not None:
            state.async_engine.stop()
