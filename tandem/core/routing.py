"""Which replica a request goes to: round-robin, least-loaded and prefix-aware routing.

Torch-free and Ray-free: the Ray Serve request router (``tandem/scale/ray_router.py``) and the
simulator's replicated engine (``tandem/sim/replicas.py``) both hand their decisions to this class,
so a policy behaves the same measured and simulated.

What a router knows about a replica comes from two places, and neither needs a call per request:
- the replica's **report** (``ReplicaReport``), pushed every ``routing_stats_period`` seconds: the
  tokens it still has to compute, its KV use, the names of the prefix blocks it holds and the ids
  of the requests it has open;
- its **own record** of what it sent there since: a request the last report did not list yet
  still counts against its replica's load, and its prefix blocks count as held there (the replica
  will compute them), so a burst of requests with one prefix lands on one replica before the next
  report says so.

Load is in tokens of work: prompt tokens not yet computed plus output tokens not yet generated
(each request's ``max_tokens`` bound), the replica's figure from its report plus the router's for
requests sent since.

Prefix-aware: the replica holding the longest run of the request's leading blocks wins, unless its
load exceeds the least-loaded replica's by more than ``imbalance_tokens`` or its KV use is at
least ``kv_high``; then, and when no replica holds any of them, least-loaded decides.
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

ROUTING_POLICIES = ("round-robin", "least-loaded", "prefix-aware")
REMEMBERED_BLOCKS = 1 << 16
"""Prefix blocks the router remembers sending to each replica (oldest forgotten first)."""


def block_name(block_hash: bytes) -> int:
    """A prefix block's 64-bit routing name: the first 8 bytes of its SHA-256 chain hash (a
    collision only misroutes, it never shares KV)."""
    return int.from_bytes(block_hash[:8], "little")


def prompt_block_names(hasher, salt: str | None, token_slice: Callable[[int, int], Sequence[int]],
                       num_tokens: int) -> tuple[int, ...]:
    """The names of a prompt's full blocks, as its replica's prefix cache names them
    (``hasher``: a ``PrefixHasher`` with the replicas' block size and namespace)."""
    hashes: list[bytes] = []
    hasher.extend(hashes, salt, token_slice, num_tokens)
    return tuple(block_name(h) for h in hashes)


def check_routing(policy: str, imbalance_tokens: int) -> None:
    """The routing settings' checks (``ServerConfig.validate`` and ``ReplicaRouter`` share them)."""
    if policy not in ROUTING_POLICIES:
        raise ValueError(f"routing: must be one of {', '.join(ROUTING_POLICIES)}, got {policy!r}")
    if not isinstance(imbalance_tokens, int) or isinstance(imbalance_tokens, bool) or imbalance_tokens < 0:
        raise ValueError(f"routing_imbalance_tokens: must be an integer >= 0, got {imbalance_tokens!r}")


@dataclass(frozen=True)
class ReplicaReport:
    outstanding_tokens: int = 0
    """Prompt tokens not yet computed plus output tokens not yet generated, over open requests."""
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    cached_blocks: frozenset[int] = frozenset()
    """``block_name``s of the full prefix blocks its cache holds."""
    open_requests: frozenset[str] = frozenset()
    """Routing ids of the requests it has accepted and not finished."""

    def to_stats(self) -> dict[str, Any]:
        """As plain data, which Ray Serve carries from the replica to the routers."""
        return {"outstanding_tokens": self.outstanding_tokens, "num_running": self.num_running,
                "num_waiting": self.num_waiting, "kv_usage": self.kv_usage,
                "cached_blocks": list(self.cached_blocks), "open_requests": list(self.open_requests)}

    @classmethod
    def from_stats(cls, stats: dict[str, Any]) -> "ReplicaReport":
        return cls(int(stats.get("outstanding_tokens", 0)), int(stats.get("num_running", 0)),
                   int(stats.get("num_waiting", 0)), float(stats.get("kv_usage", 0.0)),
                   frozenset(stats.get("cached_blocks", ())), frozenset(stats.get("open_requests", ())))


def engine_report(engine, open_requests: Iterable[str] | None = None, waiting_elsewhere: int = 0) -> ReplicaReport:
    """What ``engine`` (a ``tandem.core.engine.Engine``) reports as a replica. ``open_requests``:
    the routing ids it holds, by default its own request ids; ``waiting_elsewhere``: requests
    accepted but not yet handed to it (a server's inbox). Safe to call beside the engine's loop
    thread: it reads copies."""
    requests = list(engine.scheduler.requests.values())
    outstanding = sum(max(0, r.num_prompt_tokens - r.num_computed_tokens)
                      + max(0, r.params.max_tokens - r.num_output_tokens) for r in requests)
    ids = open_requests if open_requests is not None else (r.request_id for r in requests)
    return ReplicaReport(outstanding, engine.num_running, engine.num_waiting + waiting_elsewhere,
                         engine.allocator.usage, frozenset(block_name(h) for h in engine.allocator.cached_hashes()),
                         frozenset(ids))


@dataclass(frozen=True)
class RouteRequest:
    route_id: str
    num_prompt_tokens: int
    max_tokens: int
    block_names: tuple[int, ...] = ()
    """The prompt's full blocks, first to last (empty: no prefix information)."""

    @property
    def cost(self) -> int:
        return self.num_prompt_tokens + self.max_tokens


@dataclass(frozen=True)
class Decision:
    replica: str
    reason: str
    """round-robin, least-loaded, prefix (longest cached prefix), prefix-overloaded (it had one but
    was too loaded), or pinned."""
    matched_blocks: int = 0
    ranked: tuple[str, ...] = ()
    """Every replica, best first: where to try next if the chosen one refuses."""


@dataclass
class _Replica:
    report: ReplicaReport = field(default_factory=ReplicaReport)
    sent: dict[str, RouteRequest] = field(default_factory=dict)
    """Requests this router sent and has not seen finish."""
    recent: OrderedDict = field(default_factory=OrderedDict)
    """Block names of prompts sent here, oldest first (see the module docstring)."""


class ReplicaRouter:
    def __init__(self, policy: str = "prefix-aware", imbalance_tokens: int = 4096, kv_high: float = 0.95,
                 clock: Callable[[], float] = time.monotonic) -> None:
        check_routing(policy, imbalance_tokens)
        if not 0 < kv_high <= 1:
            raise ValueError(f"kv_high: must be in (0, 1], got {kv_high!r}")
        self.policy = policy
        self.imbalance_tokens = imbalance_tokens
        self.kv_high = kv_high
        self.clock = clock
        self._replicas: dict[str, _Replica] = {}
        self._turn = itertools.count()
        self._where: dict[str, str] = {}  # route id -> replica

    # --- membership and reports --------------------------------------------------------------------
    @property
    def replicas(self) -> list[str]:
        return sorted(self._replicas)

    def set_replicas(self, names: Sequence[str]) -> None:
        """The replicas that exist now; a removed one's record is dropped (its requests failed)."""
        for gone in set(self._replicas) - set(names):
            for route_id in self._replicas.pop(gone).sent:
                self._where.pop(route_id, None)
        for name in names:
            self._replicas.setdefault(name, _Replica())

    def report(self, name: str, report: ReplicaReport) -> None:
        replica = self._replicas.setdefault(name, _Replica())
        replica.report = report

    # --- load ----------------------------------------------------------------------------------------
    def load(self, name: str) -> int:
        """Tokens of work at ``name``: its report's, plus what was sent since that the report misses."""
        r = self._replicas[name]
        extra = sum(req.cost for rid, req in r.sent.items() if rid not in r.report.open_requests)
        return r.report.outstanding_tokens + extra

    def matched_blocks(self, name: str, request: RouteRequest) -> int:
        r = self._replicas[name]
        cached, recent = r.report.cached_blocks, r.recent
        n = 0
        for b in request.block_names:
            if b not in cached and b not in recent:
                break
            n += 1
        return n

    # --- decisions -----------------------------------------------------------------------------------
    def choose(self, request: RouteRequest, candidates: Sequence[str] | None = None) -> Decision:
        """Where ``request`` goes among ``candidates`` (default: every replica); changes nothing
        (``on_routed`` records the choice once the request is sent)."""
        names = sorted(candidates) if candidates is not None else self.replicas
        names = [n for n in names if n in self._replicas]
        if not names:
            raise LookupError("no replica to route to")
        loads = {n: self.load(n) for n in names}
        if not request.route_id:  # nothing to generate (a model list, a health check): the least loaded
            ranked = sorted(names, key=lambda n: (loads[n], self.in_flight(n)))
            return Decision(ranked[0], "least-loaded", ranked=tuple(ranked))
        turn = next(self._turn) % len(names)
        # equal loads (an idle pool) rotate, so they do not all go to the first name
        rotation = {n: (i - turn) % len(names) for i, n in enumerate(names)}
        by_load = sorted(names, key=lambda n: (loads[n], self._replicas[n].report.kv_usage, rotation[n]))
        if self.policy == "round-robin":
            first = names[turn]
            return Decision(first, "round-robin", ranked=(first, *[n for n in by_load if n != first]))
        if self.policy == "prefix-aware" and request.block_names:
            matches = {n: self.matched_blocks(n, request) for n in names}
            best = max(names, key=lambda n: (matches[n], -loads[n]))
            if matches[best] > 0:
                overloaded = (loads[best] - loads[by_load[0]] > self.imbalance_tokens
                              or self._replicas[best].report.kv_usage >= self.kv_high)
                if not overloaded:
                    return Decision(best, "prefix", matches[best], (best, *[n for n in by_load if n != best]))
                others = [n for n in by_load if n != best]
                first = others[0] if others else best
                return Decision(first, "prefix-overloaded", matches[first],
                                (first, *[n for n in by_load if n != first]))
        first = by_load[0]
        matched = self.matched_blocks(first, request) if request.block_names else 0
        return Decision(first, "least-loaded", matched, tuple(by_load))

    def on_routed(self, request: RouteRequest, name: str) -> None:
        r = self._replicas.get(name)
        if r is None:
            return
        r.sent[request.route_id] = request
        self._where[request.route_id] = name
        for b in request.block_names:
            r.recent[b] = True
            r.recent.move_to_end(b)
        while len(r.recent) > REMEMBERED_BLOCKS:
            r.recent.popitem(last=False)

    def on_finished(self, route_id: str) -> None:
        name = self._where.pop(route_id, None)
        if name is not None and name in self._replicas:
            self._replicas[name].sent.pop(route_id, None)

    def in_flight(self, name: str) -> int:
        """Requests this router sent to ``name`` and has not seen finish."""
        return len(self._replicas[name].sent)
