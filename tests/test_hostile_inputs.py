"""A table of malformed and hostile inputs, each with the status and error ``param`` it must get,
against the app in-process on a tiny model. After every row the engine must still be healthy:
``/health`` says "ok" (no engine-wide fault) and every KV block is free.

Bodies are JSON-encoded with ASCII escapes, so a lone surrogate travels as the six characters
``\\ud800`` exactly as a hostile client would send it; ``raw`` rows send bytes as they are.

Longer than 300 lines: the table is the test, one row a line, and it reads best whole."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable

import httpx
import pytest

from server_helpers import InProcessApp, assert_error, engine_idle, tiny_state

API_KEY = "hostile-key"
LIMIT = 1 << 20  # the default max_request_bytes: a 100,000-deep body fits, so depth is what refuses it
SURROGATE = "a\ud800b"
DEEP = 100_000
HUGE_DIGITS = "9" * 5000


@dataclass(frozen=True)
class Prefix:
    """A param that must start with this (e.g. any 'messages[0]...' path)."""
    head: str


@dataclass(frozen=True)
class Row:
    id: str
    path: str
    body: Any = None
    raw: bytes | None = None
    method: str = "POST"
    headers: dict[str, str] = field(default_factory=dict)
    status: int | tuple[int, ...] = 400
    param: str | None | Prefix | tuple = None
    check: Callable[[httpx.Response, InProcessApp], None] | None = None
    keyed: bool = False  # against the server that has an API key


def comp(**fields: Any) -> dict:
    return {"prompt": "w5 w6", "max_tokens": 4, **fields}


def chat(**fields: Any) -> dict:
    return {"messages": [{"role": "user", "content": "w5 w6"}], "max_tokens": 4, **fields}


def _same_as_greedy(r: httpx.Response, app: InProcessApp) -> None:
    """A tiny temperature is greedy: the same text as temperature 0 (not '<pad>' noise)."""
    sent = json.loads(r.request.content)
    greedy = app.call("POST", r.request.url.path, json={**sent, "temperature": 0})
    assert greedy.status_code == 200
    field_ = "text" if "prompt" in sent else "message"
    got, want = r.json()["choices"][0][field_], greedy.json()["choices"][0][field_]
    assert got == want and "<pad>" not in json.dumps(got), (got, want)
    if sent.get("logprobs") and "prompt" in sent:
        lp = r.json()["choices"][0]["logprobs"]
        # each token's offset points into this choice's text
        ends = [off + len(tok) for off, tok in zip(lp["text_offset"], lp["tokens"])]
        assert all(e <= len(got) for e in ends), (lp["text_offset"], got)


def _tokens(expected: list[int]) -> Callable[[httpx.Response, InProcessApp], None]:
    def check(r: httpx.Response, app: InProcessApp) -> None:
        assert r.json()["tokens"] == expected, r.json()
    return check


def _sse_done(r: httpx.Response, app: InProcessApp) -> None:
    assert r.text.endswith("data: [DONE]\n\n") and '"error"' not in r.text, r.text[-300:]


C, CHAT, TOK, DETOK = "/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"
JSON_CT = {"Content-Type": "application/json"}

ROWS = [
    # --- seed: a signed 64-bit integer -----------------------------------------------------------
    Row("seed-2**64", C, comp(temperature=1, seed=2 ** 64), param="seed"),
    Row("seed-2**63", C, comp(temperature=1, seed=2 ** 63), param="seed"),
    Row("seed-below-int64", C, comp(temperature=1, seed=-(2 ** 63) - 1), param="seed"),
    Row("seed-int64-max", C, comp(temperature=1, seed=2 ** 63 - 1), status=200),
    Row("seed-negative", C, comp(temperature=1, seed=-5), status=200),
    Row("seed-string", C, comp(seed="7"), param="seed"),
    Row("seed-float", C, comp(seed=1.5), param="seed"),
    Row("seed-2**64-n3", C, comp(temperature=1, seed=2 ** 64 - 2, n=3), param="seed"),
    Row("chat-seed-2**64", CHAT, chat(temperature=1, seed=2 ** 64), param="seed"),
    # --- max_tokens / max_completion_tokens ------------------------------------------------------
    Row("max_tokens-4.0", C, comp(max_tokens=4.0), status=200),
    Row("max_tokens-4.5", C, comp(max_tokens=4.5), param="max_tokens"),
    Row("max_tokens-0", C, comp(max_tokens=0), param="max_tokens"),
    Row("max_tokens-negative", C, comp(max_tokens=-1), param="max_tokens"),
    Row("max_tokens-huge", C, comp(max_tokens=10 ** 30), param="max_tokens"),
    Row("max_tokens-past-context", C, comp(max_tokens=600), param="max_tokens"),
    Row("max_tokens-string", C, comp(max_tokens="4"), param="max_tokens"),
    Row("max_tokens-bool", C, comp(max_tokens=True), param="max_tokens"),
    Row("max_tokens-null", C, comp(max_tokens=None), status=200),
    Row("max_completion_tokens-negative", CHAT, chat(max_completion_tokens=-1), param="max_completion_tokens"),
    Row("max_completion_tokens-huge", CHAT, chat(max_completion_tokens=10 ** 9), param="max_completion_tokens"),
    Row("max_completion_tokens-4.5", CHAT, chat(max_completion_tokens=4.5), param="max_completion_tokens"),
    Row("max_completion_tokens-4.0", CHAT, chat(max_completion_tokens=4.0), status=200),
    # --- temperature, top_p, top_k ---------------------------------------------------------------
    Row("temperature-1e-40", C, comp(temperature=1e-40, ignore_eos=True, logprobs=1), status=200,
        check=_same_as_greedy),
    Row("temperature-1e-300", C, comp(temperature=1e-300, ignore_eos=True), status=200, check=_same_as_greedy),
    Row("chat-temperature-1e-40", CHAT, chat(temperature=1e-40, ignore_eos=True), status=200,
        check=_same_as_greedy),
    Row("temperature-negative", C, comp(temperature=-0.5), param="temperature"),
    Row("temperature-string", C, comp(temperature="hot"), param="temperature"),
    Row("temperature-infinity", C, raw=b'{"prompt": "w5", "max_tokens": 4, "temperature": 1e999}',
        headers=JSON_CT, param="temperature"),
    # NaN is not JSON: refusing the literal at parse time (no param) is as right as naming the field
    Row("temperature-nan", C, raw=b'{"prompt": "w5", "max_tokens": 4, "temperature": NaN}',
        headers=JSON_CT, param=("temperature", None)),
    Row("top_p-0", C, comp(top_p=0), param="top_p"),
    Row("top_p-above-1", C, comp(top_p=1.0000001), param="top_p"),
    Row("top_p-negative", C, comp(top_p=-1), param="top_p"),
    Row("top_p-string", C, comp(top_p="x"), param="top_p"),
    Row("top_p-1e-40", C, comp(top_p=1e-40, temperature=1), status=200),
    Row("top_k-0", C, comp(top_k=0), param="top_k"),
    Row("top_k-negative", C, comp(top_k=-2), param="top_k"),
    Row("top_k-beyond-vocab", C, comp(top_k=10 ** 6, temperature=1), status=200),
    Row("top_k-float", C, comp(top_k=2.5), param="top_k"),
    # --- n, logprobs, penalties, priority, flags ---------------------------------------------------
    Row("n-0", C, comp(n=0), param="n"),
    Row("n-17", C, comp(n=17), param="n"),
    Row("n-negative", C, comp(n=-1), param="n"),
    Row("n-huge", C, comp(n=2 ** 64), param="n"),
    Row("n-string", C, comp(n="2"), param="n"),
    Row("n-times-prompts-beyond-the-queue", C, comp(prompt=["w1"] * 20, n=16), param="n"),
    Row("chat-n-0", CHAT, chat(n=0), param="n"),
    Row("logprobs-21", C, comp(logprobs=21), param="logprobs"),
    Row("logprobs-negative", C, comp(logprobs=-1), param="logprobs"),
    Row("logprobs-string", C, comp(logprobs="1"), param="logprobs"),
    Row("chat-logprobs-int", CHAT, chat(logprobs=3), param="logprobs"),
    Row("chat-top_logprobs-21", CHAT, chat(logprobs=True, top_logprobs=21), param="top_logprobs"),
    Row("chat-top_logprobs-alone", CHAT, chat(top_logprobs=2), param="top_logprobs"),
    Row("presence_penalty", C, comp(presence_penalty=2.5), param="presence_penalty"),
    Row("unknown-field", C, comp(foo_bar=1), param="foo_bar"),
    Row("frequency_penalty-string", C, comp(frequency_penalty="a"), param="frequency_penalty"),
    Row("priority-string", C, comp(priority="high"), param="priority"),
    Row("stream-string", C, comp(stream="yes"), param="stream"),
    Row("stream_options-wrong-type", C, comp(stream=True, stream_options={"include_usage": "y"}),
        param="stream_options.include_usage"),
    Row("stream-ok", C, comp(stream=True, stream_options={"include_usage": True}), status=200, check=_sse_done),
    Row("ignore_eos-string", C, comp(ignore_eos="no"), param="ignore_eos"),
    Row("echo", C, comp(echo=True), param="echo"),
    Row("suffix", C, comp(suffix="x"), param="suffix"),
    # --- stop ------------------------------------------------------------------------------------
    Row("stop-int", C, comp(stop=3), param="stop"),
    Row("stop-empty-string", C, comp(stop=[""]), param="stop"),
    Row("stop-17", C, comp(stop=[f"w{i}" for i in range(17)]), param="stop"),
    Row("stop-ints", C, comp(stop=[1, 2]), param="stop"),
    Row("stop-surrogate", C, comp(stop=[SURROGATE]), param=Prefix("stop")),
    Row("stop_token_ids-negative", C, comp(stop_token_ids=[-1]), param="stop_token_ids"),
    Row("stop_token_ids-string", C, comp(stop_token_ids="x"), param="stop_token_ids"),
    # --- model -----------------------------------------------------------------------------------
    Row("model-unknown", C, comp(model="gpt-4"), param="model"),
    Row("model-int", C, comp(model=5), param="model"),
    Row("chat-model-unknown", CHAT, chat(model="gpt-4"), param="model"),
    Row("model-surrogate", C, comp(model=SURROGATE), param="model"),  # echoed in the message: must not 500
    Row("chat-model-surrogate", CHAT, chat(model=SURROGATE), param="model"),
    # --- prompt ----------------------------------------------------------------------------------
    Row("prompt-empty", C, comp(prompt=""), param="prompt"),
    Row("prompt-empty-list", C, comp(prompt=[]), param="prompt"),
    Row("prompt-empty-token-list", C, comp(prompt=[[]]), param="prompt"),
    Row("prompt-missing", C, {"max_tokens": 4}, param="prompt"),
    Row("prompt-null", C, comp(prompt=None), param="prompt"),
    Row("prompt-int", C, comp(prompt=5), param="prompt"),
    Row("prompt-object", C, comp(prompt={"a": 1}), param="prompt"),
    Row("prompt-token-out-of-vocab", C, comp(prompt=[1, 99999]), param="prompt"),
    Row("prompt-token-negative", C, comp(prompt=[1, -1]), param="prompt"),
    Row("prompt-token-2**64", C, comp(prompt=[1, 2 ** 64]), param="prompt"),
    Row("prompt-token-bool", C, comp(prompt=[True, False]), param="prompt"),
    Row("prompt-batch-one-bad", C, comp(prompt=[[1, 5], [1, 500]]), param="prompt"),
    Row("prompt-mixed-list", C, comp(prompt=[[1, 2], "x"]), param="prompt"),
    Row("prompt-past-context", C, comp(prompt="w7 " * 600), param="prompt"),
    Row("prompt-surrogate", C, comp(prompt=SURROGATE), param="prompt"),
    Row("prompt-list-surrogate", C, comp(prompt=["w5", SURROGATE]), param=Prefix("prompt")),
    Row("prompt-surrogate-stream", C, comp(prompt=SURROGATE, stream=True), param="prompt"),
    # --- chat messages ---------------------------------------------------------------------------
    Row("messages-empty", CHAT, chat(messages=[]), param="messages"),
    Row("messages-string", CHAT, chat(messages="hello"), param="messages"),
    Row("messages-null", CHAT, chat(messages=None), param="messages"),
    Row("messages-missing", CHAT, {"max_tokens": 4}, param="messages"),
    Row("messages-role-unknown", CHAT, chat(messages=[{"role": "alien", "content": "x"}]),
        param="messages[0].role"),
    Row("messages-role-missing", CHAT, chat(messages=[{"content": "x"}]), param="messages[0].role"),
    Row("messages-content-int", CHAT, chat(messages=[{"role": "user", "content": 5}]),
        param="messages[0].content"),
    Row("messages-content-image", CHAT,
        chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
        param=Prefix("messages[0].content")),
    Row("messages-content-surrogate", CHAT, chat(messages=[{"role": "user", "content": SURROGATE}]),
        param=Prefix("messages")),
    Row("messages-part-surrogate", CHAT,
        chat(messages=[{"role": "user", "content": [{"type": "text", "text": SURROGATE}]}]),
        param=Prefix("messages")),
    Row("messages-past-context", CHAT, chat(messages=[{"role": "user", "content": "w7 " * 600}]),
        param=Prefix("messages")),
    Row("messages-text-parts-ok", CHAT,
        chat(messages=[{"role": "user", "content": [{"type": "text", "text": "w5 w6"}]}]), status=200),
    # --- /tokenize and /detokenize ---------------------------------------------------------------
    Row("tokenize-surrogate", TOK, {"prompt": SURROGATE}, param="prompt"),
    Row("tokenize-messages-surrogate", TOK, {"messages": [{"role": "user", "content": SURROGATE}]},
        param=Prefix("messages")),
    Row("tokenize-both", TOK, {"prompt": "w5", "messages": [{"role": "user", "content": "w5"}]}, param="prompt"),
    Row("tokenize-neither", TOK, {}, param="prompt"),
    Row("tokenize-prompt-int", TOK, {"prompt": 5}, param="prompt"),
    Row("tokenize-no-special-tokens", TOK, {"prompt": "w5 w6", "add_special_tokens": False}, status=200,
        check=_tokens([5, 6])),
    Row("tokenize-special-tokens", TOK, {"prompt": "w5 w6"}, status=200, check=_tokens([1, 5, 6])),
    Row("detokenize-out-of-vocab", DETOK, {"tokens": [10 ** 6]}, param="tokens[0]"),
    Row("detokenize-negative", DETOK, {"tokens": [5, -1]}, param="tokens[1]"),
    Row("detokenize-2**64", DETOK, {"tokens": [2 ** 64]}, param="tokens[0]"),
    Row("detokenize-float", DETOK, {"tokens": [1.5]}, param="tokens[0]"),
    Row("detokenize-string", DETOK, {"tokens": "abc"}, param="tokens"),
    # --- the body itself -------------------------------------------------------------------------
    Row("json-invalid", C, raw=b"{not json", headers=JSON_CT),
    Row("json-truncated", C, raw=b'{"prompt": "w5", "max_tokens"', headers=JSON_CT),
    Row("body-empty", C, raw=b"", headers=JSON_CT),
    Row("body-array", C, raw=b"[1, 2]", headers=JSON_CT),
    Row("body-string", C, raw=b'"w5 w6"', headers=JSON_CT),
    Row("body-not-utf8", C, raw=b'{"prompt": "\xff\xfe"}', headers=JSON_CT),
    Row("body-utf16", C, raw='{"prompt": "w5"}'.encode("utf-16"), headers=JSON_CT),
    Row("json-deep-arrays", C, raw=b'{"prompt": ' + b"[" * DEEP + b"]" * DEEP + b"}", headers=JSON_CT),
    Row("json-deep-objects", C, raw=b'{"prompt": "w5", "user": ' + b'{"a": ' * DEEP + b"1" + b"}" * DEEP + b"}",
        headers=JSON_CT),
    Row("tokenize-json-deep", TOK, raw=b'{"prompt": ' + b"[" * DEEP + b"]" * DEEP + b"}", headers=JSON_CT),
    # a number that long is refused by the parser (no param) or by the field's check
    Row("int-5000-digits-seed", C, raw=b'{"prompt": "w5", "max_tokens": 4, "seed": ' + HUGE_DIGITS.encode() + b"}",
        headers=JSON_CT, param=(None, "seed")),
    Row("int-5000-digits-max_tokens", C, raw=b'{"prompt": "w5", "max_tokens": ' + HUGE_DIGITS.encode() + b"}",
        headers=JSON_CT, param=(None, "max_tokens")),
    Row("int-5000-digits-detokenize", DETOK, raw=b'{"tokens": [' + HUGE_DIGITS.encode() + b"]}",
        headers=JSON_CT, param=(None, "tokens[0]")),
    Row("body-oversize", C, raw=json.dumps(comp(prompt="w5 " * (LIMIT // 3 + 10))).encode(), headers=JSON_CT,
        status=413),
    Row("tokenize-oversize", TOK, raw=json.dumps({"prompt": "w5 " * (LIMIT // 3 + 10)}).encode(), headers=JSON_CT,
        status=413),
    # --- content type, Host, method, route ------------------------------------------------------
    Row("content-type-text-plain", C, raw=json.dumps(comp()).encode(), headers={"Content-Type": "text/plain"},
        status=415),
    Row("content-type-form", C, raw=b"prompt=w5", headers={"Content-Type": "application/x-www-form-urlencoded"},
        status=415),
    Row("content-type-multipart", CHAT, raw=json.dumps(chat()).encode(),
        headers={"Content-Type": "multipart/form-data; boundary=x"}, status=415),
    Row("tokenize-text-plain", TOK, raw=b'{"prompt": "w5"}', headers={"Content-Type": "text/plain"}, status=415),
    Row("content-type-json-charset", C, raw=json.dumps(comp()).encode(),
        headers={"Content-Type": "application/json; charset=utf-8"}, status=200),
    Row("host-foreign", C, comp(), headers={"Host": "evil.example"}, status=(400, 421), param="Host"),
    Row("host-foreign-port", "/v1/models", method="GET", headers={"Host": "evil.example:8000"}, status=(400, 421), param="Host"),
    Row("host-localhost", "/v1/models", method="GET", headers={"Host": "localhost:8000"}, status=200),
    Row("host-ipv6-loopback", "/v1/models", method="GET", headers={"Host": "[::1]:8000"}, status=200),
    Row("method-get-completions", C, method="GET", status=405),
    Row("method-delete-models", "/v1/models", method="DELETE", status=405),
    Row("method-put-tokenize", TOK, method="PUT", status=405),
    Row("route-unknown", "/v1/engines", method="GET", status=404),
    Row("route-unknown-post", "/v1/embeddings", comp(), status=404),
    # --- a server with an API key ----------------------------------------------------------------
    Row("auth-missing", C, comp(), status=401, keyed=True),
    Row("auth-wrong", C, comp(), headers={"Authorization": "Bearer nope"}, status=401, keyed=True),
    Row("auth-no-scheme", C, comp(), headers={"Authorization": API_KEY}, status=401, keyed=True),
    Row("auth-key-prefix", C, comp(), headers={"Authorization": f"Bearer {API_KEY[:-1]}"}, status=401, keyed=True),
    Row("auth-tokenize", TOK, {"prompt": "w5"}, status=401, keyed=True),
    Row("auth-detokenize", DETOK, {"tokens": [5]}, status=401, keyed=True),
    Row("auth-ok", C, comp(), headers={"Authorization": f"Bearer {API_KEY}"}, status=200, keyed=True),
    Row("auth-ok-then-bad-seed", C, comp(temperature=1, seed=2 ** 64),
        headers={"Authorization": f"Bearer {API_KEY}"}, param="seed", keyed=True),
]


@pytest.fixture(scope="module")
def apps(tmp_path_factory):
    open_app = InProcessApp(tiny_state(tmp_path_factory.mktemp("hostile")))
    keyed_app = InProcessApp(tiny_state(tmp_path_factory.mktemp("hostile-keyed"), api_key=API_KEY))
    yield {False: open_app, True: keyed_app}
    keyed_app.close()
    open_app.close()


def _send(app: InProcessApp, row: Row) -> httpx.Response:
    headers = dict(row.headers)
    if row.raw is not None:
        return app.call(row.method, row.path, content=row.raw, headers=headers)
    if row.body is None:
        return app.call(row.method, row.path, headers=headers)
    headers.setdefault("Content-Type", "application/json")
    # ensure_ascii: a lone surrogate goes out as a JSON escape, as a hostile client would send it
    return app.call(row.method, row.path, content=json.dumps(row.body).encode(), headers=headers)


def _param_ok(got: str | None, want) -> bool:
    if isinstance(want, Prefix):
        return isinstance(got, str) and got.startswith(want.head)
    if isinstance(want, tuple):
        return got in want
    return got == want


@pytest.mark.parametrize("row", ROWS, ids=[r.id for r in ROWS])
def test_hostile_input(apps, row: Row):
    app = apps[row.keyed]
    before = _health(app)
    r = _send(app, row)
    statuses = row.status if isinstance(row.status, tuple) else (row.status,)
    assert r.status_code in statuses, (r.status_code, r.text[:500])
    if r.status_code >= 400:
        err = assert_error(r)
        if r.status_code == 400:
            assert _param_ok(err["param"], row.param), err
            if isinstance(err["param"], str):
                head = err["param"].split("[")[0].split(".")[0]
                assert head in err["message"], err  # the message names the field too
    if row.check is not None:
        row.check(r, app)
    # judged against the health before this row, so one row's fault does not fail every row after it
    after = _health(app)
    assert after["errors"] == before["errors"], f"this row faulted the engine: {after}"
    assert after["status"] == before["status"], after
    assert engine_idle(app.state), "the engine did not settle with every KV block free"


def _health(app: InProcessApp) -> dict:
    r = app.call("GET", "/health")
    assert r.status_code == 200, r.text
    return r.json()


def test_table_covers_enough():
    assert len(ROWS) >= 60
    assert len({r.id for r in ROWS}) == len(ROWS)


def test_engine_clean_after_the_table(apps):
    """Runs after the table (file order): nothing running or waiting, every KV block free, by the
    engine's own books and by what /metrics tells an operator."""
    for app in apps.values():
        assert engine_idle(app.state)
        engine = app.state.engine
        engine.scheduler.check_invariants()
        assert engine.allocator.all_free() and engine.num_running == 0 and app.state.async_engine.num_waiting() == 0
        metrics = app.call("GET", "/metrics").text
        usage = [line for line in metrics.splitlines() if line.startswith("tandem:kv_cache_usage_perc")]
        assert usage and all(float(line.rsplit(" ", 1)[1]) == 0 for line in usage), usage
        health = app.call("GET", "/health").json()
        assert health["status"] == "ok" and app.state.async_engine.errors == 0, health
