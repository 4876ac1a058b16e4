"""What the hostile-input, fuzz and overload tests share: a tiny-model server state, the app
driven in-process on a loop of its own (so a synchronous test or hypothesis can call it), a
real uvicorn on a free loopback port where sockets matter, and the checks every answer must
pass (the OpenAI error shape; an engine that is healthy and holds no KV blocks)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from tandem.bench.launch import free_port
from tandem.config import EngineConfig, ServerConfig
from tandem.server.routes import create_app
from tandem.server.state import ServerState, build_state
from tandem.server.unsupported import REFUSED
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


# --- request bodies for schema fuzzing (tests/test_schema_fuzz.py and benchmarks/fuzz.py) -----------

FUZZ_ROUTES = ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize")
BOUND_TOKENS = 4  # the most output tokens a fuzzed body may ask for, so a case costs milliseconds
BOUND_N = 2


def published_body_schemas(openapi: dict) -> dict[str, dict]:
    """Each fuzzed route's request-body schema as /openapi.json publishes it."""
    out = {}
    for route in FUZZ_ROUTES:
        body = openapi["paths"][route]["post"].get("requestBody")
        assert body is not None, f"{route}: /openapi.json publishes no request body"
        out[route] = body["content"]["application/json"]["schema"]
    return out


def _narrow(schema: dict, route: str, model_name: str) -> dict:
    """The published schema with ranges that mostly pass validation (the published one has types
    only, so its bodies are mostly refused by range checks and rarely reach the engine)."""
    import copy

    s = copy.deepcopy(schema)
    props = s["properties"]
    words = {"type": "string", "pattern": r"\A(w[1-9][0-9]? ){0,5}w[1-9][0-9]?\Z"}
    ids = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 383}, "minItems": 1, "maxItems": 8}
    tokens = {"type": "integer", "minimum": 1, "maximum": BOUND_TOKENS}
    narrowed = {
        "model": {"anyOf": [{"const": model_name}, {"type": "null"}]},
        "max_tokens": tokens, "max_completion_tokens": tokens,
        "temperature": {"type": "number", "minimum": 0, "maximum": 2},
        "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
        "top_k": {"anyOf": [{"const": -1}, {"type": "integer", "minimum": 1, "maximum": 500}]},
        "n": {"type": "integer", "minimum": 1, "maximum": BOUND_N},
        "seed": {"type": "integer", "minimum": -(2 ** 63), "maximum": 2 ** 63 - 1},
        "presence_penalty": {"type": "number", "minimum": -2, "maximum": 2},
        "frequency_penalty": {"type": "number", "minimum": -2, "maximum": 2},
        "repetition_penalty": {"type": "number", "exclusiveMinimum": 0, "maximum": 3},
        "min_p": {"type": "number", "minimum": 0, "maximum": 1},
        "min_tokens": {"const": 0},
        "logit_bias": {"type": "object", "maxProperties": 3, "propertyNames": {"pattern": r"\A[1-9][0-9]?\Z"},
                       "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100}},
        "bad_words": {"type": "array", "items": words, "maxItems": 3},
        "cache_salt": {"type": "string", "maxLength": 16},
        "metadata": {"type": "null"},
        **{name: {"type": "null"} for name in REFUSED},
        # structured outputs and tools have their own tests (test_structured_outputs.py): a random
        # schema is a random grammar, whose compile time is not what these tests are about
        **{name: {"type": "null"} for name in ("response_format", "guided_json", "guided_regex", "guided_choice",
                                               "guided_grammar", "structured_outputs", "tools", "tool_choice")},
        "stop": {"type": "array", "items": {"type": "string", "minLength": 1, "maxLength": 6}, "maxItems": 4},
        "stop_token_ids": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 383},
                           "maxItems": 4},
        "priority": {"type": "integer", "minimum": -10, "maximum": 10},
        "echo": {"const": False}, "suffix": {"type": "null"},
        "top_logprobs": {"type": "integer", "minimum": 0, "maximum": 5},
        "tokens": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 383}, "maxItems": 16},
    }
    if route == "/v1/completions":
        narrowed["prompt"] = {"anyOf": [words, ids, {"type": "array", "items": words, "minItems": 1, "maxItems": 3}]}
        narrowed["logprobs"] = {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 5}, {"type": "null"}]}
    message = {"type": "object", "required": ["role", "content"], "additionalProperties": False, "properties": {
        "role": {"enum": ["system", "user", "assistant"]},
        "content": {"anyOf": [words, {"type": "array", "maxItems": 2, "items": {
            "type": "object", "required": ["type", "text"], "additionalProperties": False,
            "properties": {"type": {"const": "text"}, "text": words}}}]}}}
    if "messages" in props:
        narrowed["messages"] = {"type": "array", "items": message, "minItems": 1, "maxItems": 3}
    if route == "/tokenize":
        narrowed["prompt"] = words
    for name, sub in narrowed.items():
        if name in props:
            props[name] = sub
    s["additionalProperties"] = False
    if route == "/tokenize":  # exactly one of prompt or messages
        s["oneOf"] = [{"required": ["prompt"], "not": {"required": ["messages"]}},
                      {"required": ["messages"], "not": {"required": ["prompt"]}}]
    return s


def bound_cost(body: Any, route: str) -> Any:
    """Keep a fuzzed body cheap without making it valid: a valid but large max_tokens or n is
    brought down (values past any bound are left alone, so they still get their 400), and a chat
    body that sets no length gets a small one (chat's default runs to the end of the context)."""
    if not isinstance(body, dict):
        return body
    body = dict(body)
    for name, cap in (("max_tokens", BOUND_TOKENS), ("max_completion_tokens", BOUND_TOKENS), ("n", BOUND_N)):
        v = body.get(name)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and cap < v <= 100_000:
            body[name] = cap
    if route == "/v1/chat/completions" and body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = BOUND_TOKENS
    return body


def body_strategies(schemas: dict[str, dict], model_name: str) -> dict[str, Any]:
    """Per route, hypothesis strategies of JSON-encoded bodies (bytes): from the published schema,
    from it narrowed to mostly valid values, and either of those mutated off the schema (a field
    set to arbitrary JSON, a lone surrogate, a field dropped, an unknown field, a non-object body)."""
    from hypothesis import strategies as st
    from hypothesis_jsonschema import from_schema

    scalars = (st.none() | st.booleans() | st.integers() | st.integers(min_value=2 ** 62, max_value=2 ** 70)
               | st.floats() | st.sampled_from([1e-40, 1e-300, 4.0, -0.0, 1e308]) | st.text(max_size=8)
               | st.sampled_from(["a\ud800b", "\udfff", "\x00", "\u202e", "\ufeff"]))
    any_json = st.recursive(scalars, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=6), c,
                                                                                          max_size=4), max_leaves=12)
    out = {}
    for route, schema in schemas.items():
        published = from_schema(schema)
        narrow = from_schema(_narrow(schema, route, model_name))
        names = sorted(schema["properties"])

        def mutate(body: dict, op: str, name: str, value: Any) -> Any:
            body = dict(body)
            if op == "set":
                body[name] = value
            elif op == "surrogate":
                body[name] = "w5 \ud800 w6"
            elif op == "drop":
                body.pop(name, None)
            elif op == "unknown":
                body["x_" + name] = value
            elif op == "whole":
                return value
            return body

        mutated = st.builds(mutate, published | narrow,
                            st.sampled_from(["set", "set", "set", "surrogate", "drop", "unknown", "whole"]),
                            st.sampled_from(names), any_json)

        def encode(body: Any, route: str = route) -> bytes:
            # ASCII escapes carry lone surrogates; NaN and Infinity go out as Python writes them
            return json.dumps(bound_cost(body, route)).encode()

        out[route] = {"published": published.map(encode), "narrow": narrow.map(encode),
                      "mutated": mutated.map(encode)}
    return out


def check_fuzz_answer(r: httpx.Response) -> None:
    """No 5xx; a refusal in the error shape; a success that is a complete answer."""
    assert r.status_code < 500, (r.status_code, r.text[:500])
    if r.status_code >= 400:
        assert_error(r)
    elif r.headers.get("content-type", "").startswith("text/event-stream"):
        assert r.text.endswith("data: [DONE]\n\n"), r.text[-300:]
    else:
        r.json()
