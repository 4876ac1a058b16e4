"""The torch-free routing core (tandem/core/routing.py): each policy's choice, the router's own
record between reports, and the overload rule."""

import pytest

from tandem.core.prefix_cache import PrefixHasher
from tandem.core.routing import ReplicaReport, ReplicaRouter, RouteRequest, block_name


def names(n):
    hasher = PrefixHasher(4, "ns")
    hashes = []
    hasher.extend(hashes, None, lambda a, b: list(range(a, b)), 4 * n)
    return tuple(block_name(h) for h in hashes)


def router(policy, **kw):
    r = ReplicaRouter(policy, **kw)
    r.set_replicas(["a", "b"])
    return r


def req(i, blocks=(), prompt=100, max_tokens=10):
    return RouteRequest(f"r{i}", prompt, max_tokens, blocks)


def send(r, request):
    d = r.choose(request)
    r.on_routed(request, d.replica)
    return d


def test_round_robin_alternates_whatever_the_load():
    r = router("round-robin")
    r.report("a", ReplicaReport(outstanding_tokens=10_000))
    picks = [send(r, req(i)).replica for i in range(6)]
    assert picks.count("a") == 3 and picks.count("b") == 3
    assert all(x != y for x, y in zip(picks, picks[1:]))


def test_least_loaded_counts_what_was_sent_since_the_report():
    r = router("least-loaded")
    r.report("a", ReplicaReport(outstanding_tokens=500))
    assert send(r, req(0, prompt=1000)).replica == "b"  # b: 0 < 500
    # b now carries 1,010 tokens the router sent and no report has listed: a is lighter
    assert send(r, req(1)).replica == "a"
    # once b's report lists the request, its figure replaces the router's estimate
    r.report("b", ReplicaReport(outstanding_tokens=100, open_requests=frozenset({"r0"})))
    assert r.load("b") == 100
    r.on_finished("r0")
    assert r.in_flight("b") == 0


def test_least_loaded_spreads_an_idle_pool():
    r = router("least-loaded")
    picks = [r.choose(req(i)).replica for i in range(4)]
    assert set(picks) == {"a", "b"}


def test_prefix_aware_sends_a_prefix_where_it_went_before_any_report():
    r = router("prefix-aware")
    shared = names(8)
    first = send(r, req(0, shared))
    assert first.reason == "least-loaded" and first.matched_blocks == 0
    for i in range(1, 5):
        d = send(r, req(i, shared[:6] + names(8)[6:]))
        assert d.replica == first.replica and d.reason == "prefix" and d.matched_blocks >= 6


def test_prefix_aware_uses_reported_cache_contents():
    r = router("prefix-aware")
    blocks = names(5)
    r.report("b", ReplicaReport(outstanding_tokens=300, cached_blocks=frozenset(blocks[:3])))
    d = r.choose(req(0, blocks))
    assert (d.replica, d.reason, d.matched_blocks) == ("b", "prefix", 3)
    # a hole ends the match: only the leading run counts
    r.report("a", ReplicaReport(cached_blocks=frozenset(blocks[1:])))
    assert r.matched_blocks("a", req(0, blocks)) == 0


def test_prefix_aware_passes_over_an_overloaded_holder():
    r = router("prefix-aware", imbalance_tokens=1000)
    blocks = names(4)
    r.report("b", ReplicaReport(outstanding_tokens=5000, cached_blocks=frozenset(blocks)))
    d = r.choose(req(0, blocks))
    assert (d.replica, d.reason) == ("a", "prefix-overloaded")
    r.report("b", ReplicaReport(outstanding_tokens=900, cached_blocks=frozenset(blocks)))
    assert r.choose(req(0, blocks)).replica == "b"
    r.report("b", ReplicaReport(outstanding_tokens=0, kv_usage=0.99, cached_blocks=frozenset(blocks)))
    assert r.choose(req(0, blocks)).reason == "prefix-overloaded"


def test_ranked_lists_every_candidate_once():
    r = ReplicaRouter("prefix-aware")
    r.set_replicas(["a", "b", "c"])
    d = r.choose(req(0, names(2)), candidates=["c", "a"])
    assert sorted(d.ranked) == ["a", "c"] and d.ranked[0] == d.replica


def test_a_removed_replica_drops_its_record():
    r = router("least-loaded")
    send(r, req(0))
    r.set_replicas(["a"])
    assert r.replicas == ["a"] and r.choose(req(1)).replica == "a"
    with pytest.raises(LookupError):
        r.choose(req(2), candidates=["zzz"])


@pytest.mark.parametrize("kw,field", [({"policy": "random"}, "routing"),
                                      ({"imbalance_tokens": -1}, "routing_imbalance_tokens"),
                                      ({"kv_high": 0}, "kv_high")])
def test_bad_settings_name_their_field(kw, field):
    with pytest.raises(ValueError, match=field):
        ReplicaRouter(**kw)


def test_a_request_without_route_id_goes_to_the_least_loaded_and_keeps_round_robins_turn():
    r = router("round-robin")
    r.report("a", ReplicaReport(outstanding_tokens=50))
    d = r.choose(RouteRequest("", 0, 0))
    assert d.replica == "b" and d.ranked == ("b", "a")
    assert [send(r, req(i)).replica for i in range(2)] == ["a", "b"]
