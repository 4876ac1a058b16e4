"""The OpenAI-compatible HTTP API (FastAPI), over the engine loop thread: ``create_app`` and its
routes, which read and validate a request, hand it to the engine and format the answer."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

import tandem
from tandem.server.auth import BearerAuth
from tandem.server.browser import BrowserGuard
from tandem.server.chat import ROLES
from tandem.server.fanout import Job, collect, make_jobs, merged_outputs, submit
from tandem.server.json_body import read_json
from tandem.server.middleware import ErrorGuard
from tandem.server.openai_format import full_response, response_id, sse_stream
from tandem.server.openapi import request_body
from tandem.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    USER_HEADER,
    bad_request,
    from_value_error,
    validate,
)
from tandem.server.state import ServerState, unix_time
from tandem.server.structured import compile_constraint
from tandem.server.tool_calls import ToolFormat
from tandem.server.streaming import GuardedStreamingResponse

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
            state.offload.shutdown()
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

    # the last added runs first: ErrorGuard wraps everything (anything else raising is a 500 that
    # keeps the connection), then the browser checks, then the key
    if state.api_key:
        app.add_middleware(BearerAuth, state=state)
    app.add_middleware(BrowserGuard, bind_host=state.config.host, allowed_hosts=state.config.allowed_hosts)
    app.add_middleware(ErrorGuard)

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
        engine, requested = _resolved_engine(state)
        return {"engine": engine, "requested": requested, "server": server, "model": state.model_name,
                "num_kv_blocks": state.engine.allocator.num_blocks, "max_model_len": state.engine.max_model_len,
                "paths": state.paths}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": state.model_name, "object": "model", "created": state.created, "owned_by": "tandem",
            "root": state.model_name, "parent": None, "max_model_len": state.engine.max_model_len,
        }]}

    @app.get("/metrics")
    async def metrics():
        ae = state.async_engine
        body = state.metrics.render(ae.engine.num_running, ae.num_waiting(), ae.engine.allocator.usage)
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/tokenize", openapi_extra=request_body(TokenizeRequest))
    async def tokenize(request: Request):
        req = validate(TokenizeRequest, await read_json(request, state.config.max_request_bytes, state.config.body_timeout))
        _check_model(state, req.model)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("prompt: give exactly one of prompt or messages", "prompt")
        if req.prompt is not None:
            text = req.prompt
        else:
            text = await state.offload.run(_render_chat, state, req.messages)
        ids = await state.offload.run(state.tokenizer.encode, text, add_special_tokens=req.add_special_tokens)
        # JSONResponse directly: FastAPI's encoder walks a long id list in Python, on the event loop
        return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": state.engine.max_model_len})

    @app.post("/detokenize", openapi_extra=request_body(DetokenizeRequest))
    async def detokenize(request: Request):
        req = validate(DetokenizeRequest, await read_json(request, state.config.max_request_bytes, state.config.body_timeout))
        _check_model(state, req.model)
        vocab = state.tokenizer.vocab_size
        for i, t in enumerate(req.tokens):
            if not 0 <= t < vocab:
                raise bad_request(f"tokens[{i}]: must be in [0, {vocab}), got {t}", f"tokens[{i}]")
        return {"prompt": await state.offload.run(state.tokenizer.decode_long, req.tokens, skip_special_tokens=False)}

    # --- generation --------------------------------------------------------------------------------
    @app.post("/v1/completions", openapi_extra=request_body(CompletionRequest))
    async def completions(request: Request):
        arrival = state.engine.clock()
        req = validate(CompletionRequest, await read_json(request, state.config.max_request_bytes, state.config.body_timeout))
        _check_model(state, req.model)
        params = req.sampling_params()  # SamplingParams' defaults are OpenAI's
        prompts = req.prompts()
        await _compile(state, params.constraint)
        user = req.tenant(request.headers.get(USER_HEADER))
        jobs = await state.offload.run(make_jobs, state, prompts, params, req.n, req.priority, arrival,
                              default_max=False, explicit_max=req.max_tokens is not None,
                              response_id=response_id(chat=False), user=user, cache_salt=req.cache_salt)
        return await _respond(state, request, jobs, req, chat=False)

    @app.post("/v1/chat/completions", openapi_extra=request_body(ChatCompletionRequest))
    async def chat_completions(request: Request):
        arrival = state.engine.clock()
        req = validate(ChatCompletionRequest, await read_json(request, state.config.max_request_bytes, state.config.body_timeout))
        _check_model(state, req.model)
        # chat's default max_tokens: the room left in the context (see core/sampling_params.py)
        try:
            tools = req.tool_format(state.chat.uses_model_template)
        except ValueError as exc:
            raise from_value_error(exc) from None
        params = req.sampling_params(state.engine.max_model_len, tools)
        await _compile(state, params.constraint)
        user = req.tenant(request.headers.get(USER_HEADER))
        text = await state.offload.run(_render_chat, state, req.messages, req)
        explicit = req.max_tokens is not None or req.max_completion_tokens is not None
        with req.field_names():
            jobs = await state.offload.run(make_jobs, state, [text], params, req.n, req.priority, arrival,
                                  default_max=not explicit, explicit_max=explicit, response_id=response_id(chat=True),
                                  user=user, cache_salt=req.cache_salt)
        return await _respond(state, request, jobs, req, chat=True, tools=tools)

    return app


# --- request handling helpers -------------------------------------------------------------------------


def _check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model != state.model_name:
        raise APIError(400, f"model: '{model}' does not exist; this server serves '{state.model_name}'",
                       param="model", code="model_not_found")


def _resolved_engine(state: ServerState) -> tuple[dict[str, Any], dict[str, Any]]:
    """The engine settings as they run ('auto' and unset values replaced by what was chosen), and
    the requested values of those that changed."""
    engine = state.engine_config.flat()
    resolved = {k: state.paths.get(k, engine[k]) for k in ("device", "dtype", "quantization")}
    resolved.update(max_model_len=state.engine.max_model_len, num_kv_blocks=state.engine.allocator.num_blocks)
    requested = {k: engine[k] for k, v in resolved.items() if engine[k] != v}
    engine.update(resolved)
    return engine, requested


def _render_chat(state: ServerState, messages, req: ChatCompletionRequest | None = None) -> str:
    holder = req if req is not None else ChatCompletionRequest(messages=messages)
    return state.chat.render(holder.plain_messages(ROLES), holder.tools_for_template())


async def _compile(state: ServerState, constraint) -> None:
    """A structured-output constraint compiled before its request is queued (a bad one: 400)."""
    try:
        await state.offload.run(compile_constraint, state.engine.runner, constraint)
    except ValueError as exc:
        raise from_value_error(exc) from None


async def _respond(state: ServerState, request: Request, jobs: list[Job], req, chat: bool,
                   tools: ToolFormat | None = None):
    created = unix_time()
    rid = jobs[0].response_id
    queues = await submit(state, jobs)
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return GuardedStreamingResponse(
            sse_stream(state, merged_outputs(state, jobs, queues), jobs, rid, created, chat, include_usage, tools),
            write_timeout=state.config.stream_write_timeout, media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    collecting = asyncio.ensure_future(collect(merged_outputs(state, jobs, queues)))
    watch = asyncio.ensure_future(watch_disconnect(request))
    done, _ = await asyncio.wait({collecting, watch}, return_when=asyncio.FIRST_COMPLETED)
    if collecting not in done:  # the client went away: abort everything it asked for
        collecting.cancel()
        with contextlib.suppress(asyncio.CancelledError, APIError):
            await collecting
        return Response(status_code=499)
    watch.cancel()
    finals = collecting.result()
    return full_response(state, jobs, finals, rid, created, chat, tools)


async def watch_disconnect(request: Request) -> None:
    """Returns once the client has gone away."""
    while not await request.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL_S)
