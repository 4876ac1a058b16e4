"""The first-come admission rule (tandem/server/admission.py) on a fake waiting queue: who goes in,
in which order, who is refused and what Retry-After says. Room only appears when a test says so."""

from __future__ import annotations

import asyncio

import pytest

from tandem.server.admission import MAX_RETRY_AFTER_S, AdmissionQueue, QueueFull


class Line:
    """A waiting queue with ``free`` places and the admission queue in front of it."""

    def __init__(self, free: int, capacity: int = 8, timeout: float = 60.0, clock=None) -> None:
        self.free = free
        self.entered: list[str] = []
        self.left: list[str] = []
        kwargs = {"clock": clock} if clock else {}
        self.queue = AdmissionQueue(lambda: self.free, capacity, timeout, **kwargs)

    def arrive(self, name: str, n: int = 1) -> asyncio.Task:
        def enter() -> str:
            self.free -= n
            self.entered.append(name)
            return name

        return asyncio.ensure_future(self.queue.admit(n, enter, self.left.append))

    async def room(self, n: int) -> None:
        self.free += n
        self.queue.poke()
        await settle()


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def run(coro):
    return asyncio.run(coro)


def test_room_and_nobody_ahead_goes_straight_in():
    async def scenario():
        line = Line(free=2)
        assert await line.arrive("a") == "a" and line.free == 1 and len(line.queue) == 0
    run(scenario())


def test_room_goes_to_the_earliest_arrival():
    async def scenario():
        line = Line(free=0)
        tasks = [line.arrive(name) for name in "abc"]
        await settle()
        assert line.entered == [] and len(line.queue) == 3
        await line.room(1)
        assert line.entered == ["a"]
        late = line.arrive("d")  # there is room, but b and c came first
        await line.room(0)
        assert line.entered == ["a"]
        await line.room(3)
        assert line.entered == ["a", "b", "c", "d"]
        assert [await t for t in [*tasks, late]] == ["a", "b", "c", "d"]
    run(scenario())


def test_a_client_that_retried_is_not_overtaken_by_a_newcomer():
    async def scenario():
        line = Line(free=0, capacity=2)
        first = [line.arrive("x"), line.arrive("y")]
        await settle()
        refused = line.arrive("retrier")  # the admission queue is full: refused, like anyone would be
        await settle()
        with pytest.raises(QueueFull):
            await refused
        await line.room(1)  # x goes in; a place in the line is free again
        retry = line.arrive("retrier")
        await settle()
        newcomer = line.arrive("newcomer")  # came later: the line is full again
        await settle()
        with pytest.raises(QueueFull):
            await newcomer
        await line.room(2)
        assert line.entered == ["x", "y", "retrier"]
        assert await retry == "retrier" and [await t for t in first] == ["x", "y"]
    run(scenario())


def test_the_head_that_needs_more_room_blocks_later_ones():
    async def scenario():
        line = Line(free=1)
        big = line.arrive("big", n=3)
        small = line.arrive("small", n=1)
        await settle()
        assert line.entered == []  # small fits, but big came first
        await line.room(2)
        assert line.entered == ["big"]
        await line.room(1)
        assert line.entered == ["big", "small"]
        await asyncio.gather(big, small)
    run(scenario())


def test_timeout_refuses_and_lets_the_next_in():
    async def scenario():
        line = Line(free=1, timeout=0.05)
        big = line.arrive("big", n=2)  # never fits
        await asyncio.sleep(0.02)
        small = line.arrive("small")
        with pytest.raises(QueueFull, match="admission timeout"):
            await big
        assert await small == "small" and line.entered == ["small"]
    run(scenario())


def test_no_queue_refuses_at_once():
    async def scenario():
        line = Line(free=0, capacity=0)
        with pytest.raises(QueueFull):
            await line.arrive("a")
        line = Line(free=0, capacity=4, timeout=0)
        with pytest.raises(QueueFull):
            await line.arrive("a")
    run(scenario())


def test_a_cancelled_waiter_leaves_the_line():
    async def scenario():
        line = Line(free=0)
        a, b, c = (line.arrive(name) for name in "abc")
        await settle()
        b.cancel()
        await settle()
        assert len(line.queue) == 2
        await line.room(2)
        assert line.entered == ["a", "c"] and line.left == []
        await asyncio.gather(a, c)
    run(scenario())


def test_cancelled_right_after_admission_undoes_it():
    async def scenario():
        line = Line(free=0)
        a = line.arrive("a")
        await settle()
        line.free = 1
        line.queue.poke()  # a is in the waiting queue, but its task has not resumed yet
        a.cancel()
        await settle()
        assert a.cancelled() and line.entered == ["a"] and line.left == ["a"]
    run(scenario())


def test_close_refuses_the_waiting_and_the_later():
    async def scenario():
        line = Line(free=0)
        waiting = line.arrive("a")
        await settle()
        line.queue.close(RuntimeError("shutting down"))
        with pytest.raises(RuntimeError, match="shutting down"):
            await waiting
        with pytest.raises(RuntimeError, match="shutting down"):
            await line.arrive("b")
        assert line.entered == []
    run(scenario())


def test_retry_after_is_the_time_the_line_ahead_takes():
    now = [0.0]

    async def scenario():
        line = Line(free=10, capacity=5, clock=lambda: now[0])
        assert line.queue.retry_after(1) == 1  # nothing measured yet
        for i in range(10):  # one request goes in per second
            now[0] = float(i)
            await line.arrive(f"r{i}")
        now[0] = 10.0
        assert line.queue.retry_after(1) == 1
        waiting = [line.arrive(f"w{i}") for i in range(5)]
        await settle()
        refused = line.arrive("late")
        with pytest.raises(QueueFull) as info:
            await refused
        assert info.value.retry_after == 6  # 5 ahead and itself at 1 per second
        assert line.queue.retry_after(1000) == MAX_RETRY_AFTER_S
        await line.room(5)
        await asyncio.gather(*waiting)
    run(scenario())


def test_the_engine_thread_lets_the_line_in(tmp_path):
    """Over a real engine: one running, one waiting, the rest wait in line and all complete."""
    import httpx

    from tandem.config import EngineConfig, ServerConfig
    from tandem.server.routes import create_app
    from tandem.server.state import build_state
    from tiny_models import save_tiny

    save_tiny("llama", tmp_path)
    config = EngineConfig.from_kwargs(model=str(tmp_path), dtype="float32", num_kv_blocks=64, block_size=4,
                                      max_num_seqs=1)
    state = build_state(config, ServerConfig(peak_flops=1e11, peak_memory_bandwidth=1e10, max_waiting=1,
                                             admission_queue=8, admission_timeout=20))
    app = create_app(state)

    async def scenario():
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://localhost", timeout=30) as c:
                rs = await asyncio.gather(*(c.post("/v1/completions", json={
                    "prompt": f"w{i}", "max_tokens": 8, "ignore_eos": True}) for i in range(6)))
        assert [r.status_code for r in rs] == [200] * 6
        assert state.async_engine.num_open == 0 and len(state.async_engine.admission) == 0

    asyncio.run(scenario())
