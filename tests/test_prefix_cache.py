"""Automatic prefix caching in the scheduling core: block hashes, reuse, eviction order, reference
counts under abort and preemption, the salt, and outputs identical with and without the cache
(a fake runner whose output depends on every KV slot it reads; tiny models in fp32)."""

from __future__ import annotations

import random

import pytest

from fakes import ByteTokenizer, SlotRunner
from tandem.config import SchedulerConfig
from tandem.core.engine import Engine
from tandem.core.kv_blocks import BlockAllocator
from tandem.core.prefix_cache import PrefixHasher
from tandem.core.request import SamplingParams
from tandem.core.step import KVLayout
from test_scheduler import VirtualClock, run_all

BS = 4


def make_engine(caching=True, num_blocks=256, policy="chunked", **sched):
    config = SchedulerConfig(policy=policy, enable_prefix_caching=caching, **sched)
    layout = KVLayout(num_blocks, BS)
    return Engine(config, SlotRunner(layout), ByteTokenizer(), layout, 512, clock=VirtualClock())


def params(n=6):
    return SamplingParams(max_tokens=n, ignore_eos=True)


def step_all(engine):
    outs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs[out.request_id] = out
        engine.scheduler.check_invariants()
    engine.scheduler.check_invariants()
    assert engine.allocator.all_free()
    return outs


# --- hashing -------------------------------------------------------------------------------------

def test_hash_chain_names_tokens_position_and_prefix():
    h = PrefixHasher(BS)
    a, b = [], []
    h.extend(a, None, lambda s, e: list(range(s, e)), 10)  # 2 full blocks; the partial third is not named
    assert len(a) == 2
    h.extend(b, None, lambda s, e: list(range(s, e)), 8)
    assert a == b
    # the same block of tokens behind a different first block gets another name
    c = []
    h.extend(c, None, lambda s, e: [99, 1, 2, 3, 4, 5, 6, 7][s:e], 8)
    assert c[0] != a[0] and c[1] != a[1]
    assert h.chain(h.root(None), [0, 1, 2, 3]) == a[0]


def test_salt_and_namespace_change_every_name():
    tokens = lambda s, e: list(range(s, e))  # noqa: E731
    names = []
    for hasher, salt in ((PrefixHasher(BS), None), (PrefixHasher(BS), "tenant-a"), (PrefixHasher(BS), "tenant-b"),
                         (PrefixHasher(BS, "other-model"), None)):
        out = []
        hasher.extend(out, salt, tokens, 8)
        names.append(out)
    flat = [h for out in names for h in out]
    assert len(set(flat)) == len(flat)


def test_a_hash_covers_exactly_one_block():
    with pytest.raises(ValueError, match="exactly 4 tokens"):
        PrefixHasher(BS).chain(b"", [1, 2, 3])


# --- the allocator ------------------------------------------------------------------------------

def test_freed_blocks_stay_cached_and_are_evicted_least_recently_freed_first():
    alloc = BlockAllocator(KVLayout(4, BS))
    assert alloc.grow("a", 8) and alloc.grow("b", 8)  # all four blocks held
    a_blocks, b_blocks = list(alloc.block_table("a")), list(alloc.block_table("b"))
    for i, block in enumerate(a_blocks + b_blocks):
        assert alloc.register(block, bytes([i]))
    alloc.free("a")  # a's tail block is freed (and so evicted) before its head
    alloc.free("b")
    assert alloc.num_free_blocks == 4 and alloc.num_cached_blocks == 4
    alloc.check_invariants()
    assert alloc.lookup([bytes([0]), bytes([1])]) == a_blocks
    assert alloc.lookup([bytes([1])]) == [a_blocks[1]]
    assert alloc.lookup([bytes([5]), bytes([0])]) == []  # a run starts at the first hash
    assert alloc.grow("c", 4)
    assert alloc.block_table("c") == [a_blocks[1]]  # the oldest freed: a's tail
    assert alloc.lookup([bytes([0]), bytes([1])]) == [a_blocks[0]]  # evicted: no longer found
    assert alloc.num_evictions == 1
    alloc.check_invariants()


def test_plain_blocks_are_used_before_any_cached_block_is_evicted():
    alloc = BlockAllocator(KVLayout(4, BS))
    assert alloc.grow("a", 4)
    alloc.register(alloc.block_table("a")[0], b"x")
    alloc.free("a")
    assert alloc.grow("b", 12)  # three blocks: the three plain ones
    assert alloc.lookup([b"x"]) and alloc.num_evictions == 0
    assert alloc.grow("b", 16)  # the fourth can only be the cached one
    assert not alloc.lookup([b"x"]) and alloc.num_evictions == 1
    alloc.check_invariants()


def test_shared_blocks_count_every_holder():
    alloc = BlockAllocator(KVLayout(4, BS))
    assert alloc.grow("a", 8)
    for i, block in enumerate(alloc.block_table("a")):
        alloc.register(block, bytes([i]))
    shared = alloc.lookup([bytes([0]), bytes([1])])
    alloc.attach("b", shared)
    alloc.attach("c", shared[:1])
    alloc.check_invariants()
    assert alloc.free("a") == 0  # b and c still hold them
    assert alloc.free("b") == 1  # block 1 now free, block 0 still c's
    assert alloc.free("c") == 1
    assert alloc.all_free() and alloc.num_cached_blocks == 2
    alloc.check_invariants()
    with pytest.raises(AssertionError, match="nobody holds"):
        alloc.register(0, b"y")


def test_duplicate_contents_keep_the_first_copy_and_reset_drops_only_unheld_blocks():
    alloc = BlockAllocator(KVLayout(4, BS))
    assert alloc.grow("a", 4) and alloc.grow("b", 4)
    assert alloc.register(alloc.block_table("a")[0], b"same")
    assert not alloc.register(alloc.block_table("b")[0], b"same")
    assert alloc.lookup([b"same"]) == alloc.block_table("a")
    alloc.free("b")
    assert alloc.reset_cache() == 0  # a still holds the cached block
    alloc.free("a")
    assert alloc.reset_cache() == 1 and alloc.num_cached_blocks == 0
    alloc.check_invariants()


# --- reuse through the scheduler ----------------------------------------------------------------

@pytest.mark.parametrize("shared", [6, 8, 17])  # ends inside a block, at a block boundary, the whole prompt
@pytest.mark.parametrize("policy,budget", [("chunked", 5), ("chunked", 64), ("prefill-first", 64), ("static", 64)])
def test_second_request_reuses_the_first_ones_full_blocks(shared, policy, budget):
    first = list(range(1, 18))  # 17 tokens: 4 full blocks and one token
    second = first[:shared] + [200 + i for i in range(17 - shared)]
    outs = {}
    for caching in (True, False):
        engine = make_engine(caching, policy=policy, max_num_batched_tokens=budget)
        engine.add_request(first, params(), request_id="a")
        step_all(engine)
        engine.add_request(second, params(), request_id="b")
        outs[caching] = step_all(engine)["b"]
        queried, hits = engine.scheduler.last_cache_queries, engine.scheduler.last_cached_tokens
    reused = (min(shared, 16) // BS) * BS  # full blocks only, the last token always computed
    assert outs[True].token_ids == outs[False].token_ids
    assert outs[True].num_cached_tokens == reused
    assert outs[False].num_cached_tokens == 0 and (queried, hits) == (0, 0)


def test_last_prompt_token_is_always_computed():
    engine = make_engine()
    prompt = list(range(1, 17))  # exactly 4 blocks: reuse stops one block short
    engine.add_request(prompt, params(), request_id="a")
    step_all(engine)
    engine.add_request(prompt, params(), request_id="b")
    engine.step()
    (chunk,) = engine.step_stats[-1].chunks
    assert (chunk.start, chunk.num_tokens) == (12, 4)


def test_hit_counters_match_the_shared_tokens():
    engine = make_engine()
    system = list(range(1, 33))  # 8 blocks of shared "system prompt"
    engine.add_request(system + [100, 101], params(), request_id="first")
    step_all(engine)
    for i in range(5):
        engine.add_request(system + [110 + i, 120 + i, 130 + i], params(), request_id=f"q{i}")
    step_all(engine)
    pc = engine.scheduler.prefix_cache
    assert pc.queries == 34 + 5 * 35
    assert pc.hits == 5 * 32
    assert sum(s.num_cached_tokens for s in engine.step_stats) == pc.hits
    assert sum(s.num_cache_queries for s in engine.step_stats) == pc.queries


def test_a_salt_shares_only_with_its_own_salt():
    prompt = list(range(1, 30))
    engine = make_engine()
    engine.add_request(prompt, params(), request_id="a", cache_salt="tenant-1")
    step_all(engine)
    engine.add_request(prompt, params(), request_id="b", cache_salt="tenant-2")
    engine.add_request(prompt, params(), request_id="c")  # no salt is a salt of its own
    outs = step_all(engine)
    assert outs["b"].num_cached_tokens == 0 and outs["c"].num_cached_tokens == 0
    engine.add_request(prompt, params(), request_id="d", cache_salt="tenant-1")
    assert step_all(engine)["d"].num_cached_tokens == 28
    with pytest.raises(ValueError, match="cache_salt"):
        engine.add_request(prompt, params(), cache_salt="")


def test_a_prompt_part_way_through_its_prefill_shares_what_it_has_written():
    engine = make_engine(max_num_batched_tokens=8)
    long = list(range(1, 65))  # 16 blocks: 8 steps of 8 tokens
    engine.add_request(long, params(2), request_id="long")
    for _ in range(4):
        engine.step()
    done = engine.scheduler.requests["long"].num_computed_tokens
    assert 0 < done < 64
    engine.add_request(long[:40] + [250] * 8, params(2), request_id="late")
    outs = step_all(engine)
    assert outs["late"].num_cached_tokens >= (done // BS) * BS
    reference = make_engine(caching=False)
    reference.add_request(long[:40] + [250] * 8, params(2), request_id="late")
    assert step_all(reference)["late"].token_ids == outs["late"].token_ids


def test_abort_returns_every_reference():
    engine = make_engine(max_num_batched_tokens=6)
    shared = list(range(1, 41))
    engine.add_request(shared + [1], params(), request_id="warm")
    step_all(engine)
    for i in range(4):
        engine.add_request(shared + [50 + i], params(20), request_id=f"r{i}")
    for _ in range(3):
        engine.step()
        engine.scheduler.check_invariants()
    for i in range(0, 4, 2):
        engine.abort_request(f"r{i}")
        engine.scheduler.check_invariants()
    step_all(engine)
    assert engine.allocator.num_cached_blocks > 0  # idle: cached, unreferenced, free


def test_preempted_requests_reuse_what_is_still_cached_and_outputs_do_not_change():
    rng = random.Random(4)
    system = [rng.randrange(256) for _ in range(24)]
    prompts = [system + [rng.randrange(256) for _ in range(rng.randint(1, 12))] for _ in range(8)]
    outs, engines = {}, {}
    for caching in (True, False):
        # 24 blocks of 4 tokens cannot hold 8 requests of up to 56 tokens: requests are preempted
        engine = make_engine(caching, num_blocks=24, max_num_batched_tokens=16, max_num_seqs=8)
        for i, p in enumerate(prompts):
            engine.add_request(p, params(20), request_id=f"r{i}")
        outs[caching] = {k: v.token_ids for k, v in step_all(engine).items()}
        engines[caching] = engine
    assert outs[True] == outs[False]
    with_cache, without = engines[True].scheduler, engines[False].scheduler
    assert with_cache.num_preemptions > 0 and without.num_preemptions > 0
    assert with_cache.prefix_cache.hits > 0
    # what the cache still held was not computed again
    assert with_cache.num_recomputed_tokens < without.num_recomputed_tokens


def test_random_shared_workloads_keep_every_invariant():
    rng = random.Random(11)
    heads = [[rng.randrange(256) for _ in range(rng.choice((3, 8, 20)))] for _ in range(3)]
    for trial in range(3):
        engine = make_engine(num_blocks=40, max_num_batched_tokens=rng.choice((4, 12, 48)), max_num_seqs=6)
        reference = make_engine(False, num_blocks=400, max_num_batched_tokens=512)
        arrivals = []
        for i in range(14):
            p = rng.choice(heads) + [rng.randrange(256) for _ in range(rng.randint(0, 15))]
            arrivals.append((f"r{i}", p, rng.randint(1, 12)))
        for rid, p, m in arrivals:
            reference.add_request(p, params(m), request_id=rid)
        expected = {k: v.token_ids for k, v in run_all(reference).items()}
        got = {}
        pending = list(arrivals)
        while pending or engine.has_unfinished_requests():
            for _ in range(rng.randint(0, 2)):
                if pending:
                    rid, p, m = pending.pop(0)
                    engine.add_request(p, params(m), request_id=rid)
            for out in engine.step():
                if out.finished:
                    got[out.request_id] = out.token_ids
            engine.scheduler.check_invariants()
        assert engine.allocator.all_free()
        assert got == expected, f"trial {trial}"
