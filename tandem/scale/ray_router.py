"""tandem's routing policies behind Ray Serve's request-router interface.

Ray Serve builds one router per deployment handle, in the process that holds the handle (here:
the ingress), and asks ``choose_replicas`` for ranked candidates per request. The decision is
``tandem.core.routing.ReplicaRouter``'s; this class only translates: replicas' pushed
``routing_stats`` (``EngineReplica.record_routing_stats``) become ``ReplicaReport``s, the
``Forwarded`` request's ``RouteRequest`` is what is weighed, and Ray's lifecycle hooks
(``on_request_routed``, ``on_request_completed``, ``on_replica_actor_died``) keep the router's own
record. Each candidate is returned in a rank of its own, so Ray's queue-length check only says
whether a replica takes requests at all (``max_ongoing_requests``), never which one is preferred.
That check probes a replica Ray has no recent queue length for, and takes the next rank when the
probe misses its deadline (0.1 s at first): on a busy host the preferred, idle replica would then
lose its requests to a busier one. So a candidate missing from Ray's queue-length cache is entered
with the router's own count of requests it has in flight (what Ray's cache counts for the requests
it sends); a replica that is full after all rejects the request and Ray routes it again.

Ray pickles this module by value, so it keeps no state of its own: the routers and their counters
live in ``router_directory.py``, where the ingress finds them.
"""

from __future__ import annotations

import threading
from typing import Any

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from tandem.core.routing import ReplicaReport, ReplicaRouter, RouteRequest
from tandem.scale import router_directory as directory
from tandem.scale.forward import Forwarded, Pinned

_NO_ROUTE = RouteRequest("", 0, 0)


class TandemRequestRouter(RequestRouter):
    def initialize_state(self, policy: str = "prefix-aware", imbalance_tokens: int = 4096, key: str = "tandem",
                         **_: Any) -> None:
        self.core = ReplicaRouter(policy, imbalance_tokens)
        self._seen: dict[str, Any] = {}  # replica -> the seq of the report last read
        self._stats: dict[str, dict[str, Any]] = {}
        self._pending: dict[str, tuple[RouteRequest, Any, int]] = {}  # Ray's request id -> (route, decision, matched)
        self._lock = threading.Lock()  # the ingress reads snapshots from its own thread
        directory.ROUTERS[key] = self

    # --- Ray's interface ---------------------------------------------------------------------------
    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        by_name = {r.replica_id.unique_id: r for r in candidate_replicas}
        arg = pending_request.args[0] if pending_request is not None and pending_request.args else None
        if isinstance(arg, Pinned):
            return [[by_name[arg.replica]]] if arg.replica in by_name else []
        if not by_name:
            return []
        with self._lock:
            self._refresh(candidate_replicas)
            route = arg.route if isinstance(arg, Forwarded) and arg.route is not None else None
            decision = self.core.choose(route or _NO_ROUTE, list(by_name))
            self._seed_queue_lengths([by_name[n] for n in decision.ranked])
            if pending_request is not None and route is not None:
                self._record(pending_request.metadata.internal_request_id, route, decision)
        return [[by_name[n]] for n in decision.ranked]

    def _seed_queue_lengths(self, replicas: list[RunningReplica]) -> None:
        """Ray's queue-length cache gets this router's in-flight count for each of ``replicas`` it
        holds nothing (recent) for, so no probe stands between a rank and its replica."""
        cache = getattr(self, "replica_queue_len_cache", None)  # RequestRouter's (Ray 2.60 has it)
        if cache is None:
            return
        for r in replicas:
            if cache.get(r.replica_id) is None:
                cache.update(r.replica_id, self.core.in_flight(r.replica_id.unique_id))

    def _record(self, internal: str, route: RouteRequest, decision) -> None:
        """The choice counts against its replica from now on (Ray tells a router which replica took
        a request only on some paths, and always when it finished); a retry replaces it."""
        if internal in self._pending:
            self.core.on_finished(route.route_id)
        matched = self.core.matched_blocks(decision.replica, route)
        self.core.on_routed(route, decision.replica)
        self._pending[internal] = (route, decision, matched)

    def on_request_routed(self, pending_request: PendingRequest, replica_id, result) -> None:
        internal = pending_request.metadata.internal_request_id
        with self._lock:
            entry = self._pending.get(internal)
            if entry is not None and entry[1].replica != replica_id.unique_id:  # a lower rank took it
                route = entry[0]
                self.core.on_finished(route.route_id)
                self.core.on_routed(route, replica_id.unique_id)

    def on_request_completed(self, replica_id, internal_request_id: str) -> None:
        name = replica_id.unique_id
        with self._lock:
            entry = self._pending.pop(internal_request_id, None)
            if entry is None:
                return
            route, decision, matched = entry
            self.core.on_finished(route.route_id)
        reason = decision.reason if name == decision.replica else "fallback"
        directory.ROUTED.labels(self.core.policy, name, reason).inc()
        directory.REQUESTED.labels(name).inc(len(route.block_names))
        directory.MATCHED.labels(name).inc(matched if name == decision.replica else 0)

    def on_replica_actor_died(self, replica_id) -> None:
        super().on_replica_actor_died(replica_id)
        with self._lock:
            self.core.set_replicas([r.replica_id.unique_id for r in self._replicas_list])
            self._stats.pop(replica_id.unique_id, None)

    # --- for the ingress ---------------------------------------------------------------------------
    def replica_names(self) -> list[str]:
        return [r.replica_id.unique_id for r in list(self._replicas_list)]

    def snapshot(self) -> list[dict[str, Any]]:
        """Each replica as the router sees it: its last report and the router's own record."""
        with self._lock:
            self._refresh(list(self._replicas_list))
            out = []
            for name in self.core.replicas:
                stats = self._stats.get(name, {})
                out.append({
                    "replica": name, "load_tokens": self.core.load(name), "in_flight": self.core.in_flight(name),
                    "num_running": stats.get("num_running"), "num_waiting": stats.get("num_waiting"),
                    "kv_usage": stats.get("kv_usage"), "cached_blocks": len(stats.get("cached_blocks", ())),
                    "report_time": stats.get("time"),
                })
            return out

    def _refresh(self, replicas: list[RunningReplica]) -> None:
        self.core.set_replicas([r.replica_id.unique_id for r in replicas])
        for r in replicas:
            name = r.replica_id.unique_id
            stats = r.routing_stats or {}
            if stats and stats.get("seq") != self._seen.get(name):
                self._seen[name] = stats.get("seq")
                self._stats[name] = stats
                self.core.report(name, ReplicaReport.from_stats(stats))
