"""What every route shares (``ServerState``) and ``build_state``, which wires the engine, its
loop thread, the Prometheus collectors and the optional trace together."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from tandem.config import EngineConfig, ServerConfig
from tandem.core.engine import Engine
from tandem.server.async_engine import AsyncEngine
from tandem.server.chat import ChatFormatter
from tandem.server.offload import Offload
from tandem.server.prometheus import ServerMetrics
from tandem.tokenizer import Tokenizer
from tandem.trace import TraceRecorder

log = logging.getLogger(__name__)


def unix_time() -> int:
    """OpenAI's ``created`` fields are whole Unix seconds."""
    return int(time.time())


@dataclass
class ServerState:
    engine: Engine
    async_engine: AsyncEngine
    metrics: ServerMetrics
    tracer: TraceRecorder | None
    chat: ChatFormatter
    tokenizer: Tokenizer
    model_name: str
    config: ServerConfig
    engine_config: EngineConfig
    api_key: str | None
    created: int
    paths: dict
    """``LoadedModel.paths()``: which implementation of everything runs."""
    offload: Offload
    """The worker pool for tokenizing off the event loop (``--tokenizer-threads``)."""
    paths_line: str = ""


def build_state(engine_config: EngineConfig, server_config: ServerConfig) -> ServerState:
    from tandem.build import build_engine
    from tandem.utilization import Peaks, measure_peaks

    server_config.validate()
    engine, loaded = build_engine(engine_config)
    engine.record_steps = False
    name = server_config.served_model_name or engine_config.model.model or "gemma-3-270m"
    dtype_name = "bfloat16" if str(loaded.dtype) == "torch.bfloat16" else "float32"
    if server_config.peak_flops and server_config.peak_memory_bandwidth:
        peaks = Peaks(server_config.peak_flops, server_config.peak_memory_bandwidth, measured=False)
    else:
        measured = measure_peaks(loaded.device.type, dtype_name, w8a8_kernels=loaded.w8a8_kernels,
                                 bf16_prompts=loaded.w8a8_bf16_prompts)
        peaks = Peaks(server_config.peak_flops or measured.flops_per_s,
                      server_config.peak_memory_bandwidth or measured.bytes_per_s, measured=True)
    log.info("peaks for utilization: %.1f GFLOP/s, %.1f GB/s", peaks.flops_per_s / 1e9, peaks.bytes_per_s / 1e9)
    cost = loaded.cost()
    metrics = ServerMetrics(name, cost, peaks, top_users=server_config.metrics_top_users)
    paths = loaded.paths()
    metrics.set_paths(paths)
    metrics.set_step_model(engine.step_model)  # the start-up estimate, before any step ran
    tracer = TraceRecorder(server_config.trace, engine.step_model.prior) if server_config.trace else None

    def on_step(stats, eng):
        metrics.on_step(stats, eng)
        if tracer is not None:
            tracer.on_step(stats)

    def on_finish(out):
        metrics.on_finish(out)
        if tracer is not None:
            tracer.on_finish(out)

    async_engine = AsyncEngine(engine, server_config.max_waiting, on_finish=on_finish,
                               admission_queue=server_config.admission_queue,
                               admission_timeout=server_config.admission_timeout)
    engine.on_step = lambda stats: on_step(stats, engine)  # called by step(), in the loop thread
    return ServerState(
        engine=engine, async_engine=async_engine, metrics=metrics, tracer=tracer,
        chat=ChatFormatter(loaded.tokenizer, loaded.spec.family), tokenizer=loaded.tokenizer, model_name=name,
        config=server_config, engine_config=engine_config,
        api_key=server_config.resolved_api_key(), created=unix_time(), paths=paths,
        offload=Offload(server_config.tokenizer_threads), paths_line=loaded.paths_line(),
    )
