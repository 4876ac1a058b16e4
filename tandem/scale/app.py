"""The replicated server as a Ray Serve application: ``engine`` (N ``EngineReplica``s with
tandem's request router) behind ``ingress``; ``serve_replicated`` runs it for ``tandem serve
--replicas N``: a local Ray instance for the server's lifetime, or ``--ray-address`` to join a
cluster (then only this application is removed on exit, not Serve or Ray)."""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import threading

from tandem.config import EngineConfig, ServerConfig

APP_NAME = "tandem"
PINNED_CALL_ROOM = 64
"""Calls beyond the request queues a replica must still accept (/metrics, /health)."""


def replica_threads(engine_config: EngineConfig, replicas: int) -> int:
    """Each replica's share of the CPU threads (at least one)."""
    from tandem.kernels.cpu_features import available_cores

    return max(1, (engine_config.model.threads or available_cores()) // replicas)


def uses_gpu(engine_config: EngineConfig) -> bool:
    device = engine_config.model.device
    if device == "auto":
        import torch
        return torch.cuda.is_available()
    return device == "cuda"


def build_application(engine_config: EngineConfig, server_config: ServerConfig, log_level: str = "warning"):
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from tandem.scale.ingress import ROUTER_KEY, Ingress
    from tandem.scale.replica import EngineReplica

    n = server_config.replicas
    threads = replica_threads(engine_config, n)
    replica_engine = dataclasses.replace(engine_config, model=dataclasses.replace(engine_config.model, threads=threads))
    replica_server = dataclasses.replace(server_config, replicas=1, ray_address=None, trace=None)
    gpu = uses_gpu(engine_config)
    logging_config = {"log_level": log_level.upper(), "enable_access_log": log_level.lower() == "debug"}
    period = server_config.routing_stats_period
    engine = serve.deployment(EngineReplica, name="engine").options(
        num_replicas=n,
        ray_actor_options={"num_cpus": 0 if gpu else threads, "num_gpus": 1 if gpu else 0},
        max_ongoing_requests=(server_config.max_waiting + server_config.admission_queue
                              + engine_config.scheduler.max_num_seqs + PINNED_CALL_ROOM),
        request_router_config=RequestRouterConfig(
            request_router_class="tandem.scale.ray_router.TandemRequestRouter",
            request_router_kwargs={"policy": server_config.routing,
                                   "imbalance_tokens": server_config.routing_imbalance_tokens, "key": ROUTER_KEY},
            request_routing_stats_period_s=period, request_routing_stats_timeout_s=max(5.0, 4 * period)),
        graceful_shutdown_timeout_s=server_config.shutdown_timeout,
        health_check_period_s=2.0, health_check_timeout_s=30.0, logging_config=logging_config,
    )
    ingress = serve.deployment(serve.ingress()(Ingress), name="ingress").options(
        num_replicas=1, ray_actor_options={"num_cpus": 0}, max_ongoing_requests=server_config.max_connections,
        logging_config=logging_config,
    )
    return ingress.bind(engine.bind(replica_engine, replica_server), engine_config, server_config)


def serve_replicated(engine_config: EngineConfig, server_config: ServerConfig, log_level: str = "info",
                     on_started=None, stop: threading.Event | None = None) -> int:
    """Serve until SIGINT/SIGTERM (or ``stop`` is set); returns the exit status."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    try:
        import ray  # noqa: F401
        from ray import serve  # noqa: F401
    except ImportError:
        print("tandem: error: replicas: serving several replicas needs Ray Serve: pip install 'ray[serve]' "
              "(or install tandem with its [ray] extra)", file=sys.stderr)
        return 1
    from tandem.model_files import load_tokenizer
    from tandem.server.serve import PortInUse, bind

    try:
        bind(server_config.host, server_config.port).close()  # a taken port fails now, not after Ray started
    except PortInUse as exc:
        print(f"tandem: error: {exc}", file=sys.stderr)
        return 1
    load_tokenizer(engine_config.model)  # converts a GGUF file once, before the replicas look for it

    n = server_config.replicas
    joined = server_config.ray_address not in (None, "local")  # "local": a new local instance, as without it
    if not ray.is_initialized():
        cpus = None if joined else max(os.cpu_count() or 1, n * replica_threads(engine_config, n))
        ray.init(address=server_config.ray_address, num_cpus=cpus, include_dashboard=False,
                 logging_level=log_level.upper(), log_to_driver=True)
    stop = stop or threading.Event()
    try:
        serve.start(http_options={"host": server_config.host, "port": server_config.port})
        print(f"starting {n} replica(s) on Ray Serve ...", file=sys.stderr, flush=True)
        serve.run(build_application(engine_config, server_config, log_level), name=APP_NAME, route_prefix="/")
        print(f"tandem serving with {n} replica(s), routing {server_config.routing}, on "
              f"http://{server_config.host}:{server_config.port}", file=sys.stderr, flush=True)
        if on_started is not None:
            on_started()
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, lambda *_: stop.set())
        stop.wait()
        print("tandem: shutting down the replicas ...", file=sys.stderr, flush=True)
    finally:
        if joined:
            serve.delete(APP_NAME)
        else:
            serve.shutdown()
        ray.shutdown()  # stops a local instance; only disconnects from a cluster
    return 0
