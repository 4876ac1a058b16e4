"""An exception inside the engine fails only the request that causes it; the server keeps
serving, and /health reports a fault only when it is the engine's (no request could be served).
The app runs in-process so the runner can be rigged."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tandem.config import EngineConfig, ServerConfig
from tandem.server.routes import create_app
from tandem.server.state import build_state
from tiny_models import save_tiny

POISON = 13  # a step whose input holds this token id raises
BROKEN = {"on": False}  # while on, every step raises: the engine is at fault, not a request


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("faults")
    save_tiny("llama", d)
    return d


@pytest.fixture
def state(model_dir):
    d = model_dir
    config = EngineConfig.from_kwargs(model=str(d), dtype="float32", num_kv_blocks=64, block_size=4,
                                      policy="prefill-first", max_num_seqs=1)
    st = build_state(config, ServerConfig(peak_flops=1e11, peak_memory_bandwidth=1e10))
    runner = st.engine.runner
    real = runner.execute

    def rigged(out):
        if BROKEN["on"]:
            raise RuntimeError("simulated broken device")
        if any(POISON in c.token_ids for c in out.chunks):
            raise RuntimeError("simulated kernel failure")
        return real(out)

    runner.execute = rigged
    return st


def test_engine_fault_is_contained(state):
    async def scenario():
        app = create_app(state)
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://localhost", timeout=30) as c:
                assert (await c.get("/health")).json()["status"] == "ok"
                good = c.post("/v1/completions", json={"prompt": "w5 w6", "max_tokens": 5, "ignore_eos": True})
                bad = c.post("/v1/completions", json={"prompt": [1, POISON], "max_tokens": 5})
                good2 = c.post("/v1/completions", json={"prompt": "w7", "max_tokens": 3, "ignore_eos": True})
                r_good, r_bad, r_good2 = await asyncio.gather(good, bad, good2)
                assert r_bad.status_code == 500
                err = r_bad.json()["error"]
                assert err["type"] == "server_error" and "simulated kernel failure" in err["message"]
                assert r_good.status_code == 200 and r_good.json()["usage"]["completion_tokens"] == 5
                assert r_good2.status_code == 200
                health = (await c.get("/health")).json()
                assert health["status"] == "ok" and health["errors"] == 0, health  # the request's fault
                stream = await c.post("/v1/completions",
                                      json={"prompt": [1, POISON], "max_tokens": 5, "stream": True})
                assert stream.status_code == 200 and '"error"' in stream.text and stream.text.endswith("[DONE]\n\n")
                after = await c.post("/v1/completions", json={"prompt": "w8", "max_tokens": 2})
                assert after.status_code == 200
                metrics = (await c.get("/metrics")).text
                assert 'finished_reason="error"' in metrics
                assert (await c.get("/health")).json()["status"] == "ok"
        assert state.engine.allocator.all_free()

    asyncio.run(scenario())


def test_engine_wide_fault_degrades_health(state):
    async def scenario():
        app = create_app(state)
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://localhost", timeout=30) as c:
                BROKEN["on"] = True
                try:
                    # one request a step (max_num_seqs=1): two lone failures in a row, nothing served between
                    rs = await asyncio.gather(*[c.post("/v1/completions", json={"prompt": "w5", "max_tokens": 2})
                                                for _ in range(2)])
                finally:
                    BROKEN["on"] = False
                assert [r.status_code for r in rs] == [500, 500]
                health = (await c.get("/health")).json()
                assert health["status"] == "degraded" and "simulated broken device" in health["last_error"]
                assert (await c.post("/v1/completions", json={"prompt": "w8", "max_tokens": 2})).status_code == 200
        assert state.engine.allocator.all_free()

    asyncio.run(scenario())
