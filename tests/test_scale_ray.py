"""The replicated server on a local Ray instance: 2 tiny-model replicas with one thread each behind
the ingress. Answers and errors match the single-process server's, each routing policy spreads
requests as documented, and a replica killed mid-stream ends its stream with an error event while
new requests go to the replica alive. Run alone with ``pytest -m ray``."""

from __future__ import annotations

import json
import re
import time

import httpx
import pytest

ray = pytest.importorskip("ray")
from ray import serve  # noqa: E402

from server_helpers import assert_error, tiny_state  # noqa: E402
from tandem.bench.launch import free_port  # noqa: E402
from tandem.config import EngineConfig, ServerConfig  # noqa: E402
from tandem.scale.app import APP_NAME, build_application  # noqa: E402
from tiny_models import save_tiny  # noqa: E402

pytestmark = pytest.mark.ray
KEY = "sekrit"
AUTH = {"Authorization": f"Bearer {KEY}"}
SHARED = " ".join(f"w{i}" for i in range(40, 104))  # 64 words: 16 full blocks of 4 tokens


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    model = tmp_path_factory.mktemp("tiny")
    save_tiny("llama", model)
    port = free_port()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="WARNING")
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield model, port
    serve.shutdown()
    ray.shutdown()


def deploy(cluster, **server):
    model, port = cluster
    engine = EngineConfig.from_kwargs(model=str(model), dtype="float32", num_kv_blocks=256, block_size=4,
                                      max_num_seqs=4, threads=2)
    settings = ServerConfig(port=port, replicas=2, api_key=KEY, peak_flops=1e11, peak_memory_bandwidth=1e10,
                            routing_stats_period=0.2, **server)
    serve.run(build_application(engine, settings), name=APP_NAME, route_prefix="/")
    return httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60)


def routed(client, expect: int = 0) -> dict[tuple[str, str], float]:
    """(replica, reason) -> requests the router sent, from the ingress's /metrics (a request is
    counted once Ray reports it finished, just after its answer: wait for ``expect`` of them)."""
    deadline = time.monotonic() + 10
    while True:
        out = {}
        for line in client.get("/metrics").text.splitlines():
            m = re.match(r'tandem:router_requests_total\{(.*)\} (\S+)', line)
            if m:
                labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
                out[(labels["replica"], labels["reason"])] = float(m.group(2))
        if sum(out.values()) >= expect or time.monotonic() > deadline:
            return out
        time.sleep(0.1)


def per_replica(counts) -> dict[str, float]:
    out: dict[str, float] = {}
    for (replica, _), n in counts.items():
        out[replica] = out.get(replica, 0) + n
    return out


def complete(client, prompt, max_tokens=4, **extra):
    r = client.post("/v1/completions", headers=AUTH,
                    json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def prefix_client(cluster):
    with deploy(cluster, routing="prefix-aware") as client:
        yield client


def test_answers_streamed_and_not_like_one_server(prefix_client, tmp_path):
    body = complete(prefix_client, "w1 w2 w3", max_tokens=6)
    assert body["usage"]["completion_tokens"] == 6
    text = ""
    with prefix_client.stream("POST", "/v1/completions", headers=AUTH,
                              json={"prompt": "w1 w2 w3", "max_tokens": 6, "temperature": 0, "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
    assert text == body["choices"][0]["text"]
    chat = prefix_client.post("/v1/chat/completions", headers=AUTH,
                              json={"messages": [{"role": "user", "content": "w5 w6"}], "max_tokens": 3})
    assert chat.status_code == 200 and chat.json()["choices"][0]["message"]["role"] == "assistant"
    assert prefix_client.get("/v1/models", headers=AUTH).json()["data"][0]["id"]


@pytest.mark.parametrize("body,headers", [
    ({"prompt": "w1", "max_tokens": "x"}, AUTH),
    ({"prompt": "w1", "model": "nope"}, AUTH),
    ({"prompt": "w1", "bogus": 1}, AUTH),
    ({"prompt": "w1"}, {}),
    ({"prompt": "w1"}, {"Authorization": "Bearer wrong"}),
])
def test_errors_are_the_single_process_servers(prefix_client, tmp_path, body, headers):
    import asyncio

    state = tiny_state(tmp_path, api_key=KEY)
    from tandem.server.routes import create_app

    async def local():
        transport = httpx.ASGITransport(app=create_app(state))
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:8000") as c:
            return await c.post("/v1/completions", json=body, headers=headers)

    want = asyncio.run(local())
    got = prefix_client.post("/v1/completions", json=body, headers=headers)
    assert got.status_code == want.status_code
    err = assert_error(got)
    assert (err["param"], err["code"], err["type"]) == tuple(want.json()["error"][k] for k in ("param", "code", "type"))
    assert err["message"].replace(str(tmp_path), "M") == want.json()["error"]["message"].replace(str(tmp_path), "M") \
        or err["param"] == "model"


def _prefix_blocks(text: str) -> tuple[float, float]:
    """The router's (matched, requested) prefix blocks, summed over replicas."""
    return tuple(sum(float(v) for v in re.findall(rf'tandem:router_prefix_blocks_{kind}_total\{{[^}}]*\}} (\S+)', text))
                 for kind in ("matched", "requested"))


def test_prefix_aware_keeps_a_prefix_on_one_replica(prefix_client):
    """On the deployment the tests above used: counted from what the router had counted before."""
    client = prefix_client
    before, blocks_before = routed(client), _prefix_blocks(client.get("/metrics").text)
    cached = [complete(client, f"{SHARED} q{i}")["usage"]["prompt_tokens_details"]["cached_tokens"]
              for i in range(6)]
    after = routed(client, sum(before.values()) + 6)
    counts = {k: v - before.get(k, 0) for k, v in after.items() if v > before.get(k, 0)}
    assert len(per_replica(counts)) == 1, counts  # every one went where the first did
    assert sum(n for (_, reason), n in counts.items() if reason == "prefix") == 5
    assert cached[0] == 0 and all(c == 64 for c in cached[1:]), cached
    text = client.get("/metrics").text
    matched, requested = (a - b for a, b in zip(_prefix_blocks(text), blocks_before))
    assert matched == 5 * 16 and requested == 6 * 16
    replicas = set(re.findall(r'tandem:num_requests_running\{[^}]*replica="(\w+)"', text))
    assert len(replicas) == 2
    health = client.get("/health").json()
    assert health == {"status": "ok", "replicas": 2, "replicas_alive": 2}
    listed = client.get("/replicas").json()
    assert listed["routing"] == "prefix-aware" and len(listed["replicas"]) == 2


def test_round_robin_alternates_and_the_body_limit_holds_at_the_ingress(cluster):
    with deploy(cluster, routing="round-robin", max_request_bytes=1000) as client:
        for i in range(6):
            complete(client, f"{SHARED} r{i}")
        counts = per_replica(routed(client, 6))
        assert sorted(counts.values()) == [3, 3], counts
        r = client.post("/v1/completions", headers=AUTH, json={"prompt": "w1 " * 600})
        assert_error(r, 413)


@pytest.fixture(scope="module")
def least_loaded_client(cluster):
    """One least-loaded deployment for the routing test and then the killed-replica test (which
    runs last in this module: it leaves a replaced replica behind)."""
    with deploy(cluster, routing="least-loaded") as client:
        yield client


def test_least_loaded_avoids_the_busy_replica(least_loaded_client):
    """Three short requests sent one after another while a long one runs all go to the other
    replica. The long request (400 tokens of a tiny model) may finish before the third short one
    is routed on a fast machine: such an attempt proves nothing and is run again."""
    client = least_loaded_client
    for attempt in range(5):
        before = routed(client)
        with client.stream("POST", "/v1/completions", headers=AUTH,
                           json={"prompt": "w1 w2", "max_tokens": 400, "ignore_eos": True, "stream": True}) as long:
            lines = long.iter_lines()
            next(lines)  # the long request runs
            busy = next(x["replica"] for x in client.get("/replicas").json()["replicas"] if x["in_flight"])
            for i in range(3):
                complete(client, f"w{i} w9", max_tokens=2)
            still_busy = any(x["replica"] == busy and x["in_flight"]
                             for x in client.get("/replicas").json()["replicas"])
            for _ in lines:
                pass
        after = routed(client, sum(before.values()) + 4)  # the three short ones and the long one
        counts = per_replica({k: v - before.get(k, 0) for k, v in after.items() if v > before.get(k, 0)})
        if still_busy:
            assert counts.get(busy) == 1 and sum(counts.values()) == 4, counts  # only the long one
            return
    pytest.fail("the long request ended before the short ones were routed in every attempt")


def test_a_killed_replica_ends_its_stream_and_others_serve(least_loaded_client):
    client = least_loaded_client
    with client.stream("POST", "/v1/completions", headers=AUTH,
                       json={"prompt": "w1 w2", "max_tokens": 500, "ignore_eos": True, "stream": True}) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        replicas = client.get("/replicas").json()["replicas"]
        victim = next(x for x in replicas if x["in_flight"] > 0)
        ray.kill(ray.get_actor(victim["actor_name"], namespace="serve"), no_restart=True)
        started = time.monotonic()
        rest = [line[6:] for line in lines if line.startswith("data: ")]
        assert time.monotonic() - started < 30
    assert rest[-1] == "[DONE]"
    last = json.loads(rest[-2])
    assert last.get("error", {}).get("code") == "replica_failed" or "choices" in last, rest[-3:]
    # new requests go to the replica alive (allow the router a moment to learn of the death)
    deadline, ok = time.monotonic() + 30, 0
    while ok < 3 and time.monotonic() < deadline:
        r = client.post("/v1/completions", headers=AUTH, json={"prompt": "w3", "max_tokens": 2})
        ok = ok + 1 if r.status_code == 200 else 0
    assert ok == 3
    # Ray Serve replaces it
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and client.get("/health").json().get("replicas_alive") != 2:
        time.sleep(1)
    assert client.get("/health").json()["replicas_alive"] == 2
