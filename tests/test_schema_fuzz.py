"""Schema fuzzing: /openapi.json publishes the request bodies of the completion, chat, tokenize and
detokenize routes, and bodies generated from it (as published, narrowed to mostly valid values,
and mutated off it) never get a 5xx: every refusal is a 4xx in OpenAI's error shape, and the
engine stays healthy with every KV block free. Derandomized, so CI runs the same cases each time;
``benchmarks/fuzz.py`` runs more of them against a real server."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, Phase, given, settings

from server_helpers import (
    FUZZ_ROUTES,
    InProcessApp,
    body_strategies,
    check_fuzz_answer,
    engine_idle,
    published_body_schemas,
    tiny_state,
)

# cases per (route, kind); 315 in all
CASES = {
    ("/v1/completions", "published"): 40, ("/v1/completions", "narrow"): 45, ("/v1/completions", "mutated"): 45,
    ("/v1/chat/completions", "published"): 30, ("/v1/chat/completions", "narrow"): 35,
    ("/v1/chat/completions", "mutated"): 40,
    ("/tokenize", "published"): 15, ("/tokenize", "narrow"): 15, ("/tokenize", "mutated"): 20,
    ("/detokenize", "published"): 15, ("/detokenize", "mutated"): 15,
}


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    a = InProcessApp(tiny_state(tmp_path_factory.mktemp("fuzz")))
    yield a
    a.close()


@pytest.fixture(scope="module")
def strategies(app):
    openapi = app.call("GET", "/openapi.json").json()
    return body_strategies(published_body_schemas(openapi), app.state.model_name)


def test_openapi_publishes_the_request_bodies(app):
    openapi = app.call("GET", "/openapi.json").json()
    schemas = published_body_schemas(openapi)
    assert set(schemas) == set(FUZZ_ROUTES)
    assert "prompt" in schemas["/v1/completions"]["required"]
    assert "messages" in schemas["/v1/chat/completions"]["required"]
    for name in ("max_tokens", "temperature", "seed", "n", "stop", "logprobs"):
        assert name in schemas["/v1/completions"]["properties"], name
    assert "max_completion_tokens" in schemas["/v1/chat/completions"]["properties"]
    assert "$ref" not in str(schemas), "a body schema must stand alone"


def test_cases_enough():
    assert sum(CASES.values()) >= 300


@pytest.mark.parametrize("route, kind", list(CASES), ids=[f"{r}-{k}" for r, k in CASES])
def test_fuzzed_bodies_never_5xx(app, strategies, route, kind):
    errors_before = app.state.async_engine.errors
    seen: dict[int, int] = {}

    # no shrinking: a failure reports the first failing body, which derandomize makes repeatable,
    # instead of spending minutes on a smaller one
    @settings(max_examples=CASES[route, kind], derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck), phases=[Phase.generate], report_multiple_bugs=False)
    @given(strategies[route][kind])
    def one(raw: bytes) -> None:
        r = app.call("POST", route, content=raw, headers={"Content-Type": "application/json"})
        seen[r.status_code] = seen.get(r.status_code, 0) + 1
        check_fuzz_answer(r)
        assert app.state.async_engine.errors == errors_before, app.state.async_engine.last_error

    one()
    assert engine_idle(app.state), "the engine did not settle with every KV block free"
    assert app.call("GET", "/health").json()["status"] == "ok"
    if kind == "narrow":  # narrowed bodies mostly pass validation and reach the engine
        assert seen.get(200, 0) >= CASES[route, kind] // 3, seen
