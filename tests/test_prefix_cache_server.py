"""The prefix cache as a client sees it: ``usage.prompt_tokens_details.cached_tokens`` in every
response (streamed too), the ``tandem:prefix_cache_*`` counters in /metrics agreeing with the
responses and with what the prompts share, ``cache_salt`` validated and keeping tenants apart."""

from __future__ import annotations

import json
import re

import pytest

from server_helpers import InProcessApp, assert_error, engine_idle, tiny_state
from tandem.bench.conversations import shareable_tokens

SYSTEM = list(range(5, 45))  # 40 tokens: 10 blocks of 4


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    state = tiny_state(tmp_path_factory.mktemp("prefix-server"))
    app = InProcessApp(state, base_url="http://localhost")
    yield app
    app.close()


def counter(app, name: str) -> float:
    text = app.call("GET", "/metrics").text
    m = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def complete(app, prompt, **extra):
    r = app.call("POST", "/v1/completions", json={"prompt": prompt, "max_tokens": 3, "temperature": 0, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def test_cached_tokens_in_usage_and_metrics_agree_with_the_shared_prefix(app):
    q0, h0 = counter(app, "tandem:prefix_cache_queries_total"), counter(app, "tandem:prefix_cache_hits_total")
    prompts = [SYSTEM + [100 + i, 200 + i, 300 + i] for i in range(4)]
    cached = [complete(app, p)["usage"]["prompt_tokens_details"]["cached_tokens"] for p in prompts]
    assert cached == [0, 40, 40, 40]
    assert engine_idle(app.state)
    hits = counter(app, "tandem:prefix_cache_hits_total") - h0
    queries = counter(app, "tandem:prefix_cache_queries_total") - q0
    assert hits == sum(cached) == shareable_tokens(prompts, 4)
    assert queries == sum(len(p) for p in prompts)
    assert counter(app, "tandem:prefix_cache_blocks") >= 10


def test_streamed_usage_reports_cached_tokens(app):
    complete(app, SYSTEM + [7, 7, 7])
    r = app.call("POST", "/v1/completions", json={"prompt": SYSTEM + [9, 9, 9], "max_tokens": 3, "temperature": 0,
                                                   "stream": True, "stream_options": {"include_usage": True}})
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    assert events[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 40


def test_a_salt_keeps_tenants_apart(app):
    prompt = SYSTEM[::-1] + [1, 2, 3]
    assert complete(app, prompt, cache_salt="a")["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert complete(app, prompt, cache_salt="b")["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert complete(app, prompt, cache_salt="a")["usage"]["prompt_tokens_details"]["cached_tokens"] == 40


@pytest.mark.parametrize("salt", ["", "x" * 257, 5, ["a"]])
def test_bad_salts_are_refused_naming_the_field(app, salt):
    r = app.call("POST", "/v1/completions", json={"prompt": "hi", "max_tokens": 2, "cache_salt": salt})
    assert assert_error(r, 400)["param"] == "cache_salt"
