"""The OpenAI-compatible HTTP API (FastAPI), over the engine loop thread."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import logging
import os
import time
import uuid
from dataclasses import dataclass, replace
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

import tandem
from tandem.config import EngineConfig, ServerConfig
from tandem.core.engine import Engine
from tandem.core.outputs import RequestOutput
from tandem.core.request import Request as EngineRequest
from tandem.core.request import SamplingParams
from tandem.server.async_engine import AsyncEngine, QueueFull
from tandem.server.chat import ROLES, ChatFormatter
from tandem.server.prometheus import ServerMetrics
from tandem.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    bad_request,
    from_value_error,
    validate,
)
from tandem.tokenizer import Tokenizer
from tandem.trace import TraceRecorder

log = logging.getLogger(__name__)

DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions
DISCONNECT_POLL_S = 0.2
RETRY_AFTER_S = 1


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


def create_app(state: ServerState) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        state.async_engine.start()
        try:
            yield
        finally:
            state.async_engine.stop()
            if state.tracer is not None:
                path = state.tracer.write()
                log.info("trace written to %s", path)

    app = FastAPI(title="tandem", version=tandem.__version__, lifespan=lifespan)
    app.state.tandem = state

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        err = APIError(exc.status_code, str(exc.detail), type_="not_found_error" if exc.status_code == 404 else None)
        return JSONResponse(err.body(), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.exception("unhandled error")
        return JSONResponse(APIError(500, f"internal error: {type(exc).__name__}: {exc}").body(), status_code=500)

    if state.api_key:
        app.add_middleware(BearerAuth, state=state)

    # --- plain routes -----------------------------------------------------------------------------
    @app.get("/health")
    async def health():
        ae = state.async_engine
        if not ae.alive:
            return JSONResponse({"status": "dead", "last_error": ae.last_error}, status_code=503)
        body: dict[str, Any] = {"status": "ok" if ae.errors == 0 else "degraded", "errors": ae.errors}
        if ae.last_error:
            body["last_error"] = ae.last_error
            body["last_error_time"] = ae.last_error_time
        return body

    @app.get("/version")
    async def version():
        return {"version": tandem.__version__}

    @app.get("/config")
    async def config():
        """The engine and server settings, so a benchmark can record what it ran against."""
        server = {k: v for k, v in dataclasses.asdict(state.config).items() if k != "api_key"}
        return {"engine": state.engine_config.flat(), "server": server, "model": state.model_name,
                "num_kv_blocks": state.engine.allocator.num_blocks, "max_model_len": state.engine.max_model_len}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": state.model_name, "object": "model", "created": state.created, "owned_by": "tandem",
            "max_model_len": state.engine.max_model_len,
        }]}

    @app.get("/metrics")
    async def metrics():
        ae = state.async_engine
        body = state.metrics.render(ae.engine.num_running, ae.num_waiting(), ae.engine.allocator.usage)
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/tokenize")
    async def tokenize(request: Request):
        req = validate(TokenizeRequest, await _read_json(request, state.config.max_request_bytes))
        _check_model(state, req.model)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("prompt: give exactly one of prompt or messages", "prompt")
        text = req.prompt if req.prompt is not None else _render_chat(state, req.messages)
        ids = state.tokenizer.encode(text)
        return {"tokens": ids, "count": len(ids), "max_model_len": state.engine.max_model_len}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        req = validate(DetokenizeRequest, await _read_json(request, state.config.max_request_bytes))
        _check_model(state, req.model)
        vocab = state.tokenizer.vocab_size
        for i, t in enumerate(req.tokens):
            if not 0 <= t < vocab:
                raise bad_request(f"tokens[{i}]: must be in [0, {vocab}), got {t}", f"tokens[{i}]")
        return {"prompt": state.tokenizer.decode(req.tokens, skip_special_tokens=False)}

    # --- generation --------------------------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(request: Request):
        arrival = state.engine.clock()
        req = validate(CompletionRequest, await _read_json(request, state.config.max_request_bytes))
        _check_model(state, req.model)
        params = req.sampling_params(DEFAULT_COMPLETION_TOKENS)
        prompts = req.prompts()
        jobs = _make_jobs(state, prompts, params, req.n, req.priority, arrival, default_max=False,
                          explicit_max=req.max_tokens is not None)
        return await _respond(state, request, jobs, req, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        arrival = state.engine.clock()
        req = validate(ChatCompletionRequest, await _read_json(request, state.config.max_request_bytes))
        _check_model(state, req.model)
        params = req.sampling_params(state.engine.max_model_len)
        text = _render_chat(state, req.messages, req)
        explicit = req.max_tokens is not None or req.max_completion_tokens is not None
        jobs = _make_jobs(state, [text], params, req.n, req.priority, arrival, default_max=not explicit,
                          explicit_max=explicit)
        return await _respond(state, request, jobs, req, chat=True)

    return app


class BearerAuth:
    """Plain ASGI middleware (not BaseHTTPMiddleware, which hides client disconnects from the
    routes): every /v1 route needs ``Authorization: Bearer <key>``."""

    def __init__(self, app, state: ServerState) -> None:
        self.app = app
        self.state = state
        self.expected = f"Bearer {state.api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            auth = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(auth, self.expected):
                self.state.metrics.reject("unauthorized")
                err = APIError(401, "missing or wrong API key (expected 'Authorization: Bearer <key>')",
                               code="invalid_api_key")
                await JSONResponse(err.body(), status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


# --- request handling helpers -------------------------------------------------------------------------


async def _read_json(request: Request, limit: int) -> Any:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"request body of {declared} bytes exceeds the limit of {limit} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"request body exceeds the limit of {limit} bytes")
        chunks.append(chunk)
    raw = b"".join(chunks)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise bad_request(f"the request body is not valid UTF-8 (byte {exc.start})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}") from None


def _check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model != state.model_name:
        raise APIError(400, f"model: '{model}' does not exist; this server serves '{state.model_name}'",
                       param="model", code="model_not_found")


def _render_chat(state: ServerState, messages, req: ChatCompletionRequest | None = None) -> str:
    holder = req if req is not None else ChatCompletionRequest(messages=messages)
    return state.chat.render(holder.plain_messages(ROLES))


@dataclass
class _Job:
    index: int  # choice index
    prompt_index: int
    request: EngineRequest


def _make_jobs(state: ServerState, prompts: list, params: SamplingParams, n: int, priority: int, arrival: float,
               default_max: bool, explicit_max: bool) -> list[_Job]:
    engine = state.engine
    base = uuid.uuid4().hex[:16]
    jobs: list[_Job] = []
    for pi, prompt in enumerate(prompts):
        if isinstance(prompt, list) and not all(isinstance(t, int) for t in prompt):
            raise bad_request(f"prompt[{pi}]: must be a string or a list of token ids", "prompt")
        for j in range(n):
            p = params
            if params.seed is not None and j:
                p = replace(params, seed=params.seed + j)
            try:
                request = engine.make_request(prompt, p, request_id=f"{base}-{pi}-{j}", arrival_time=arrival,
                                              priority=priority)
            except ValueError as exc:
                raise from_value_error(exc) from None
            room = engine.max_model_len - request.num_prompt_tokens
            if default_max:
                request.params = replace(request.params, max_tokens=room)
            elif request.params.max_tokens > room:
                param = "max_tokens" if explicit_max else "prompt"
                raise bad_request(
                    f"{param}: the prompt ({request.num_prompt_tokens} tokens) plus max_tokens "
                    f"({request.params.max_tokens}) exceeds the context length of {engine.max_model_len} tokens",
                    param,
                )
            jobs.append(_Job(len(jobs), pi, request))
    ae = state.async_engine
    if ae.num_waiting() + len(jobs) > ae.max_waiting:
        state.metrics.reject("queue_full")
        raise APIError(429, f"the server is at its queue bound ({ae.max_waiting} waiting requests); retry later",
                       headers={"Retry-After": str(RETRY_AFTER_S)})
    return jobs


def _submit(state: ServerState, jobs: list[_Job]) -> list[asyncio.Queue]:
    """Hand every job to the engine loop, or none of them (429) if the queue is full."""
    queues: list[asyncio.Queue] = []
    try:
        for job in jobs:
            queues.append(state.async_engine.submit(job.request))
    except QueueFull as exc:
        for job in jobs[: len(queues)]:
            state.async_engine.abort(job.request.request_id)
        state.metrics.reject("queue_full")
        raise APIError(429, f"the server is at its queue bound: {exc}; retry later",
                       headers={"Retry-After": str(RETRY_AFTER_S)}) from None
    return queues


async def _merged(state: ServerState, jobs: list[_Job], queues: list[asyncio.Queue]
                  ) -> AsyncIterator[tuple[_Job, RequestOutput]]:
    """Outputs of all jobs as they come; closing the iterator aborts every unfinished job."""
    merged: asyncio.Queue = asyncio.Queue()

    async def pump(job: _Job, queue: asyncio.Queue) -> None:
        while True:
            item = await queue.get()
            merged.put_nowait((job, item))
            if isinstance(item, BaseException) or item.finished:
                return

    pumps = [asyncio.ensure_future(pump(job, q)) for job, q in zip(jobs, queues)]
    remaining = {job.request.request_id for job in jobs}
    try:
        while remaining:
            job, item = await merged.get()
            if isinstance(item, BaseException) or item.finished:
                remaining.discard(job.request.request_id)
            if isinstance(item, BaseException):
                raise APIError(500, f"request failed: {item}")
            yield job, item
    finally:
        for task in pumps:
            task.cancel()
        for request_id in remaining:
            state.async_engine.abort(request_id)


def _now() -> int:
    return int(time.time())


async def _respond(state: ServerState, request: Request, jobs: list[_Job], req, chat: bool):
    created = _now()
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    queues = _submit(state, jobs)
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return StreamingResponse(
            _sse(state, _merged(state, jobs, queues), jobs, rid, created, chat, include_usage),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    collect = asyncio.ensure_future(_collect(_merged(state, jobs, queues)))
    watch = asyncio.ensure_future(_watch_disconnect(request))
    done, _ = await asyncio.wait({collect, watch}, return_when=asyncio.FIRST_COMPLETED)
    if collect not in done:  # the client went away: abort everything it asked for
        collect.cancel()
        with contextlib.suppress(asyncio.CancelledError, APIError):
            await collect
        return Response(status_code=499)
    watch.cancel()
    finals = collect.result()
    return _full_response(state, jobs, finals, rid, created, chat)


async def _watch_disconnect(request: Request) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL_S)


async def _collect(stream) -> dict[int, RequestOutput]:
    finals: dict[int, RequestOutput] = {}
    async for job, out in stream:
        if out.finished:
            if out.error is not None:
                raise APIError(500, f"the engine failed while running this request: {out.error}")
            finals[job.index] = out
    return finals


def _usage(jobs: list[_Job], outputs: dict[int, RequestOutput]) -> dict[str, int]:
    # a prompt counts once, however many choices (n) it has
    prompt = sum({j.prompt_index: j.request.num_prompt_tokens for j in jobs}.values())
    completion = sum(len(o.token_ids) for o in outputs.values())
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _token_text(state: ServerState, token_id: int) -> str:
    return state.tokenizer.decode([token_id], skip_special_tokens=False)


def _completion_logprobs(state: ServerState, lps, text_offset: int = 0) -> dict[str, Any]:
    tokens, token_logprobs, top, offsets = [], [], [], []
    pos = text_offset
    for lp in lps:
        s = _token_text(state, lp.token_id)
        tokens.append(s)
        token_logprobs.append(lp.logprob)
        top.append({_token_text(state, t): v for t, v in lp.top})
        offsets.append(pos)
        pos += len(s)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def _chat_logprobs(state: ServerState, lps) -> dict[str, Any]:
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        s = _token_text(state, token_id)
        return {"token": s, "logprob": logprob, "bytes": list(s.encode("utf-8"))}

    return {"content": [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
                        for lp in lps]}


def _full_response(state, jobs, finals, rid, created, chat) -> dict[str, Any]:
    choices = []
    for job in jobs:
        out = finals[job.index]
        want_lp = job.request.params.logprobs is not None
        if chat:
            choices.append({
                "index": job.index,
                "message": {"role": "assistant", "content": out.text},
                "logprobs": _chat_logprobs(state, out.logprobs) if want_lp else None,
                "finish_reason": out.finish_reason,
            })
        else:
            choices.append({
                "index": job.index, "text": out.text,
                "logprobs": _completion_logprobs(state, out.logprobs) if want_lp else None,
                "finish_reason": out.finish_reason,
            })
    return {
        "id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
        "model": state.model_name, "choices": choices, "usage": _usage(jobs, finals),
    }


def _event(data: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n".encode()


async def _sse(state, stream, jobs, rid, created, chat, include_usage) -> AsyncIterator[bytes]:
    obj = "chat.completion.chunk" if chat else "text_completion"
    sent_lp: dict[int, int] = {}
    text_offset: dict[int, int] = {}
    finals: dict[int, RequestOutput] = {}

    def chunk(choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> bytes:
        body: dict[str, Any] = {"id": rid, "object": obj, "created": created, "model": state.model_name,
                                "choices": choices}
        if include_usage:
            body["usage"] = usage
        return _event(body)

    if chat:
        yield chunk([{"index": j.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                      "finish_reason": None} for j in jobs])

    try:
        async for job, out in stream:
            if out.finished and out.error is not None:
                err = APIError(500, f"the engine failed while running this request: {out.error}")
                yield _event(err.body())
                break
            new_lps = out.logprobs[sent_lp.get(job.index, 0):]
            sent_lp[job.index] = len(out.logprobs)
            want_lp = job.request.params.logprobs is not None
            if not out.delta_text and not out.finished and not (want_lp and new_lps):
                continue
            reason = out.finish_reason if out.finished else None
            if chat:
                choice = {"index": job.index, "delta": {"content": out.delta_text},
                          "logprobs": _chat_logprobs(state, new_lps) if want_lp else None, "finish_reason": reason}
            else:
                off = text_offset.get(job.index, 0)
                choice = {"index": job.index, "text": out.delta_text,
                          "logprobs": _completion_logprobs(state, new_lps, off) if want_lp else None,
                          "finish_reason": reason}
                text_offset[job.index] = off + len(out.delta_text)
            if out.finished:
                finals[job.index] = out
            yield chunk([choice])
        else:
            if include_usage:
                yield chunk([], _usage(jobs, finals))
    except APIError as exc:
        yield _event(exc.body())
    finally:
        await stream.aclose()
    yield b"data: [DONE]\n\n"


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
        measured = measure_peaks(loaded.device.type, dtype_name)
        peaks = Peaks(server_config.peak_flops or measured.flops_per_s,
                      server_config.peak_memory_bandwidth or measured.bytes_per_s, measured=True)
    log.info("peaks for utilization: %.1f GFLOP/s, %.1f GB/s", peaks.flops_per_s / 1e9, peaks.bytes_per_s / 1e9)
    cost = loaded.cost()
    metrics = ServerMetrics(name, cost, peaks)
    tracer = TraceRecorder(server_config.trace) if server_config.trace else None

    def on_step(stats, eng):
        metrics.on_step(stats, eng)
        if tracer is not None:
            tracer.on_step(stats)

    def on_finish(out):
        metrics.on_finish(out)
        if tracer is not None:
            tracer.on_finish(out)

    async_engine = AsyncEngine(engine, server_config.max_waiting, on_finish=on_finish)
    engine.on_step = lambda stats: on_step(stats, engine)  # called by step(), in the loop thread
    return ServerState(
        engine=engine, async_engine=async_engine, metrics=metrics, tracer=tracer,
        chat=ChatFormatter(loaded.tokenizer, loaded.spec.family), tokenizer=loaded.tokenizer, model_name=name,
        config=server_config, engine_config=engine_config,
        api_key=server_config.api_key or os.environ.get("TANDEM_API_KEY") or None, created=_now(),
    )
