"""The Ray router enters its own in-flight counts in Ray's queue-length cache for replicas the cache
holds nothing for, so Ray routes to the preferred rank without a probe that could miss its
deadline on a busy host and hand the request to the next rank; entries Ray has stay as they are."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("ray")
from ray.serve._private.common import DeploymentID, ReplicaID  # noqa: E402
from ray.serve._private.request_router.common import ReplicaQueueLengthCache  # noqa: E402

from tandem.core.routing import ReplicaRouter, RouteRequest  # noqa: E402
from tandem.scale.ray_router import TandemRequestRouter  # noqa: E402


def replica(name: str) -> SimpleNamespace:
    return SimpleNamespace(replica_id=ReplicaID(name, DeploymentID("engine", "tandem")))


def test_missing_entries_get_the_routers_in_flight_count_and_present_ones_stay():
    idle, busy, known = replica("idle"), replica("busy"), replica("known")
    core = ReplicaRouter("least-loaded")
    core.set_replicas(["idle", "busy", "known"])
    core.on_routed(RouteRequest("long", 2, 400), "busy")
    core.on_routed(RouteRequest("other", 2, 10), "busy")
    cache = ReplicaQueueLengthCache()
    cache.update(known.replica_id, 5)  # what Ray itself learned stays
    router = SimpleNamespace(core=core, replica_queue_len_cache=cache)

    TandemRequestRouter._seed_queue_lengths(router, [idle, busy, known])

    assert cache.get(idle.replica_id) == 0
    assert cache.get(busy.replica_id) == 2
    assert cache.get(known.replica_id) == 5
