"""The OpenAI-compatible HTTP API (FastAPI), over the engine loop thread: ``create_app`` and its
routes, which read and validate a request, hand it to the engine and format the answer."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

import tandem
from tandem.server.auth import BearerAuth
from tandem.server.chat import ROLES
from tandem.server.fanout import Job, collect, make_jobs, merged_outputs, submit
from tandem.server.json_body import read_json
from tandem.server.openai_format import full_response, response_id, sse_stream
from tandem.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    bad_request,
    validate,
)
from tandem.server.state import ServerState, unix_time

log = logging.getLogger(__name__)

DISCONNECT_POLL_S = 0.2


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
                "num_kv_blocks": state.engine.allocator.num_blocks, "max_model_len": state.engine.max_model_len,
                "paths": state.paths}

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
        req = validate(TokenizeRequest, await read_json(request, state.config.max_request_bytes))
        _check_model(state, req.model)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("prompt: give exactly one of prompt or messages", "prompt")
        text = req.prompt if req.prompt is not None else _render_chat(state, req.messages)
        ids = state.tokenizer.encode(text)
        return {"tokens": ids, "count": len(ids), "max_model_len": state.engine.max_model_len}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        req = validate(DetokenizeRequest, await read_json(request, state.config.max_request_bytes))
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
        req = validate(CompletionRequest, await read_json(request, state.config.max_request_bytes))
        _check_model(state, req.model)
        params = req.sampling_params()  # SamplingParams' defaults are OpenAI's
        prompts = req.prompts()
        jobs = make_jobs(state, prompts, params, req.n, req.priority, arrival, default_max=False,
                         explicit_max=req.max_tokens is not None)
        return await _respond(state, request, jobs, req, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        arrival = state.engine.clock()
        req = validate(ChatCompletionRequest, await read_json(request, state.config.max_request_bytes))
        _check_model(state, req.model)
        # chat's default max_tokens: the room left in the context (see core/sampling_params.py)
        params = req.sampling_params(state.engine.max_model_len)
        text = _render_chat(state, req.messages, req)
        explicit = req.max_tokens is not None or req.max_completion_tokens is not None
        with req.field_names():
            jobs = make_jobs(state, [text], params, req.n, req.priority, arrival, default_max=not explicit,
                             explicit_max=explicit)
        return await _respond(state, request, jobs, req, chat=True)

    return app


# --- request handling helpers -------------------------------------------------------------------------


def _check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model != state.model_name:
        raise APIError(400, f"model: '{model}' does not exist; this server serves '{state.model_name}'",
                       param="model", code="model_not_found")


def _render_chat(state: ServerState, messages, req: ChatCompletionRequest | None = None) -> str:
    holder = req if req is not None else ChatCompletionRequest(messages=messages)
    return state.chat.render(holder.plain_messages(ROLES))


async def _respond(state: ServerState, request: Request, jobs: list[Job], req, chat: bool):
    created = unix_time()
    rid = response_id(chat)
    queues = submit(state, jobs)
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return StreamingResponse(
            sse_stream(state, merged_outputs(state, jobs, queues), jobs, rid, created, chat, include_usage),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    collecting = asyncio.ensure_future(collect(merged_outputs(state, jobs, queues)))
    watch = asyncio.ensure_future(_watch_disconnect(request))
    done, _ = await asyncio.wait({collecting, watch}, return_when=asyncio.FIRST_COMPLETED)
    if collecting not in done:  # the client went away: abort everything it asked for
        collecting.cancel()
        with contextlib.suppress(asyncio.CancelledError, APIError):
            await collecting
        return Response(status_code=499)
    watch.cancel()
    finals = collecting.result()
    return full_response(state, jobs, finals, rid, created, chat)


async def _watch_disconnect(request: Request) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL_S)
