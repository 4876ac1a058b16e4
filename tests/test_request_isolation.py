"""A request that makes its step raise fails alone: the other requests of the step get the same
tokens they get when run alone, its KV blocks are returned, and only a failure no request can be
blamed for counts as the engine's. Also the sampling inputs that used to raise or return garbage
inside a step: 64-bit seeds, tiny temperatures and tiny top_p."""

from __future__ import annotations

import asyncio
import random
import threading

import httpx
import pytest

from tandem import LLM, SamplingParams
from tandem.config import EngineConfig, ServerConfig
from tandem.server.routes import create_app
from tandem.server.state import build_state
from tiny_models import VOCAB, save_tiny

POISON = 13  # a chunk holding this token among its prompt positions makes the step raise
DECODE_POISON_MAX_TOKENS = 13  # a decode chunk of a request with this max_tokens makes the step raise
SAMPLER_POISON_SEED = 666  # making this request's generator raises, inside the sampler


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("isolation")
    save_tiny("llama", d)
    return str(d)


def _poisoned(chunk) -> bool:
    prompt_part = chunk.token_ids[: max(0, chunk.num_prompt_tokens - chunk.start)]
    return POISON in prompt_part or (chunk.is_decode and chunk.sampling.max_tokens == DECODE_POISON_MAX_TOKENS)


def _rig(runner) -> None:
    real_execute = runner.execute
    real_generator = runner.sampler._generator

    def execute(out):
        if any(_poisoned(c) for c in out.chunks):
            raise RuntimeError("simulated kernel failure")
        return real_execute(out)

    def generator(request_id, params):
        if params.seed == SAMPLER_POISON_SEED:
            raise RuntimeError("simulated generator failure")
        return real_generator(request_id, params)

    runner.execute = execute
    runner.sampler._generator = generator


@pytest.fixture(scope="module")
def llm(model_dir):
    llm = LLM(model_dir, dtype="float32", device="cpu", policy="chunked", max_num_seqs=8,
              max_num_batched_tokens=512, num_kv_blocks=128, block_size=4)
    _rig(llm.engine.runner)
    return llm


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[1] + [rng.choice([t for t in range(3, VOCAB) if t != POISON]) for _ in range(rng.randint(3, 20))]
            for _ in range(n)]


GOOD_PARAMS = [
    SamplingParams(max_tokens=10, temperature=0, ignore_eos=True),
    SamplingParams(max_tokens=7, temperature=1.0, seed=1, ignore_eos=True),
    SamplingParams(max_tokens=12, temperature=0.8, top_k=20, seed=2, ignore_eos=True),
    SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logprobs=2),
    SamplingParams(max_tokens=9, temperature=1.2, top_p=0.9, seed=3, ignore_eos=True),
    SamplingParams(max_tokens=8, temperature=0.7, seed=4, ignore_eos=True),
]


def _run_all(engine, requests):
    """Add every (prompt, params) at once and step to the end: the final outputs in order and
    each step's ``step_fault``."""
    ids = [engine.add_request(p, sp) for p, sp in requests]
    final, steps = {}, []
    while engine.has_unfinished_requests():
        outs = engine.step()
        steps.append(engine.step_fault)
        for out in outs:
            if out.finished:
                final[out.request_id] = out
    return [final[i] for i in ids], steps


@pytest.mark.parametrize("culprit", [
    ("prompt", SamplingParams(max_tokens=5, temperature=0)),
    ("decode", SamplingParams(max_tokens=DECODE_POISON_MAX_TOKENS, temperature=0, ignore_eos=True)),
    ("sampler", SamplingParams(max_tokens=5, temperature=1.0, seed=SAMPLER_POISON_SEED, ignore_eos=True)),
], ids=lambda c: c[0])
def test_culprit_fails_alone_beside_six_good_requests(llm, culprit):
    kind, bad_params = culprit
    engine = llm.engine
    good = list(zip(_prompts(6), GOOD_PARAMS))
    alone = [_run_all(engine, [g])[0][0] for g in good]
    bad_prompt = [1, 40, POISON, 41] if kind == "prompt" else [1, 40, 41]
    # the culprit sits in the middle, and after the seeded rows of the batch it fails in
    together, steps = _run_all(engine, good[:3] + [(bad_prompt, bad_params)] + good[3:])
    bad = together.pop(3)
    assert bad.finished and bad.finish_reason == "error" and "simulated" in bad.error
    if kind == "decode":
        assert len(bad.token_ids) == 1  # it kept the token of its prefill, then failed at its first decode
    for a, t in zip(alone, together):
        assert t.error is None and t.finish_reason == "length"
        assert t.token_ids == a.token_ids and t.text == a.text
        assert [lp.token_id for lp in t.logprobs] == [lp.token_id for lp in a.logprobs]
    assert engine.step_stats[-len(steps):][0].num_seqs == 7  # all started together
    failed = [s for s in engine.step_stats[-len(steps):] if s.error is not None]
    assert len(failed) == 1 and failed[0].num_seqs == 7  # it failed in a step it shared with the six
    assert all(fault is None for fault in steps)  # a request's fault, not the engine's
    assert engine.allocator.all_free()


def test_every_request_failing_is_an_engine_fault(llm):
    engine = llm.engine
    outs, steps = _run_all(engine, [([1, POISON, 5], SamplingParams(max_tokens=3)),
                                    ([1, 6, POISON], SamplingParams(max_tokens=3))])
    assert all(o.finish_reason == "error" for o in outs)
    assert steps[-1] is not None and "simulated kernel failure" in steps[-1]
    assert engine.allocator.all_free()


def test_a_lone_failure_is_judged_by_the_next_step(llm):
    engine = llm.engine
    _run_all(engine, [([1, 8], SamplingParams(max_tokens=1))])
    lone = ([1, POISON, 7], SamplingParams(max_tokens=3))
    _, steps = _run_all(engine, [lone])
    assert steps[-1] is None  # cannot tell yet
    _, steps = _run_all(engine, [([1, 8, 9], SamplingParams(max_tokens=2))])
    assert all(fault is None for fault in steps)  # the runner works: it was the request
    _run_all(engine, [lone])
    _, steps = _run_all(engine, [lone])  # two lone failures in a row, nothing served between
    assert steps[-1] is not None


def test_sixty_four_bit_seeds(llm):
    prompt = _prompts(1, seed=5)[0]

    def tokens(seed):
        return llm.generate(prompt, SamplingParams(max_tokens=8, temperature=1.0, seed=seed, ignore_eos=True)
                            )[0].token_ids

    # signed seeds are their two's complement, as torch's generator takes them
    assert tokens(-1) == tokens((1 << 64) - 1)
    assert tokens(-(1 << 63)) == tokens(1 << 63)
    for bad in (1 << 64, -(1 << 63) - 1, 10 ** 30):
        with pytest.raises(ValueError, match="^seed:"):
            SamplingParams(seed=bad)


def test_tiny_temperatures_are_greedy(llm):
    ps = _prompts(3, seed=7)
    greedy = [o.token_ids for o in llm.generate(ps, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))]
    for t in (1e-300, 1e-40, 1e-6):
        params = SamplingParams(max_tokens=12, temperature=t, ignore_eos=True, logprobs=1)
        outs = llm.generate(ps, params)
        assert [o.token_ids for o in outs] == greedy, t
        assert all(lp.token_id == tok for o in outs for lp, tok in zip(o.logprobs, o.token_ids))
    # a top_p that rounds to 0 in float32 keeps the most likely token instead of none
    outs = llm.generate(ps, SamplingParams(max_tokens=12, temperature=1.0, top_p=1e-300, seed=0, ignore_eos=True))
    assert [o.token_ids for o in outs] == greedy


# --- over HTTP: one client's poisoned request beside six others ---------------------------------------


def test_collateral_over_http(model_dir):
    config = EngineConfig.from_kwargs(model=model_dir, dtype="float32", num_kv_blocks=128, block_size=4,
                                      policy="chunked", max_num_seqs=8, max_num_batched_tokens=512)
    state = build_state(config, ServerConfig(peak_flops=1e11, peak_memory_bandwidth=1e10))
    runner = state.engine.runner
    state.engine.record_steps = True
    _rig(runner)
    gate = threading.Event()
    rigged = runner.execute

    def gated(out):  # hold the loop in a step so the next requests all arrive together
        gate.wait(timeout=30)
        return rigged(out)

    bodies = [{"prompt": p, "max_tokens": 6, "ignore_eos": True, "temperature": t, "seed": i}
              for i, (p, t) in enumerate(zip(["w5 w6", "w7", "w8 w9 w10", "w11", "w12 w14", "w15"],
                                             [0, 1.0, 0, 0.9, 1.1, 0]))]
    bad = {"prompt": [1, 20, POISON], "max_tokens": 6}

    async def scenario():
        app = create_app(state)
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://localhost", timeout=60) as c:
                alone = [(await c.post("/v1/completions", json=b)).json()["choices"][0]["text"] for b in bodies]
                gate.clear()
                runner.execute = gated
                hold = asyncio.ensure_future(c.post("/v1/completions", json={"prompt": "w3", "max_tokens": 1}))
                await asyncio.sleep(0.2)
                posts = [asyncio.ensure_future(c.post("/v1/completions", json=b)) for b in bodies[:3] + [bad]
                         + bodies[3:]]
                await asyncio.sleep(0.3)
                runner.execute = rigged
                gate.set()
                responses = await asyncio.gather(*posts)
                assert (await hold).status_code == 200
                r_bad = responses.pop(3)
                assert r_bad.status_code == 500 and "simulated kernel failure" in r_bad.json()["error"]["message"]
                assert [r.status_code for r in responses] == [200] * 6
                assert [r.json()["choices"][0]["text"] for r in responses] == alone
                failed = [s for s in state.engine.step_stats if s.error is not None]
                assert len(failed) == 1 and failed[0].num_seqs == 7
                health = (await c.get("/health")).json()
                assert health["status"] == "ok", health
                # the failed step's good requests still count: 6 good requests, 6 tokens each, twice,
                # and the holding request's one token
                text = (await c.get("/metrics")).text
                generated = next(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                                 if line.startswith("tandem:generation_tokens_total{"))
                assert generated == 2 * 6 * 6 + 1
        assert state.engine.allocator.all_free()

    asyncio.run(scenario())
