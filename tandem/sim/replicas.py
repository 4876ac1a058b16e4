"""N simulated engine replicas behind one router, driven as one engine by the replay loop.

Each replica is a whole simulated engine (its own scheduler, KV cache and virtual clock, which
reads the time the replica is busy until). They run in parallel in virtual time, as a discrete-
event loop: the composite's clock is the simulated wall time, and ``step`` moves it to the next
event (the earliest start of a replica's next step, or the end of a step in progress) and steps
the replica whose step starts then. N replicas therefore do N times the work in the same virtual
time.

The router (``tandem.core.routing``, the one Ray Serve's request router uses) knows what it would
know there, no more: each replica's report, taken at that replica's step boundaries and at most
once every ``stats_period`` virtual seconds (stale in between); its own record of what it sent;
and each finish at the virtual time the request finished, not when the loop happened to compute
it (a replica's step is computed at its start, its results belong to its end).
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
from collections import Counter
from dataclasses import dataclass, field
from typing import Sequence

from tandem.core.engine import Engine
from tandem.core.outputs import RequestOutput
from tandem.core.prefix_cache import PrefixHasher
from tandem.core.routing import Decision, ReplicaRouter, RouteRequest, engine_report, prompt_block_names
from tandem.core.sampling_params import SamplingParams
from tandem.sim.runner import VirtualClock


@dataclass
class ReplicaTally:
    """What one replica was sent, for the report."""

    requests: int = 0
    reasons: Counter = field(default_factory=Counter)
    requested_blocks: int = 0
    """Full blocks of the prompts routed here."""
    expected_blocks: int = 0
    """Of those, the leading blocks the router believed this replica held when it chose it."""
    hit_blocks: int = 0
    """Of those, the blocks its KV cache really served when the request was admitted."""


class ReplicatedSimEngine:
    """``engines``: the replicas, simulated engines on virtual clocks of their own (``sim_engine``),
    of one configuration; ``routing``, ``imbalance_tokens``, ``stats_period``: as `tandem serve`'s
    ``--routing``, ``--routing-imbalance-tokens`` and ``--routing-stats-period``."""

    def __init__(self, engines: Sequence[Engine], routing: str = "prefix-aware", imbalance_tokens: int = 4096,
                 stats_period: float = 0.5) -> None:
        if not engines:
            raise ValueError("replicas: must be >= 1, got 0")
        if not all(hasattr(e.clock, "advance_to") for e in engines):
            raise ValueError("replicas: every replica must be a simulated engine on a virtual clock")
        if isinstance(stats_period, bool) or not isinstance(stats_period, (int, float)) or not stats_period > 0:
            raise ValueError(f"routing_stats_period: must be > 0, got {stats_period!r}")
        self.engines = list(engines)
        self.names = [f"replica-{i}" for i in range(len(self.engines))]
        self.clock = VirtualClock(max(e.clock() for e in self.engines))
        self.router = ReplicaRouter(routing, imbalance_tokens, clock=self.clock)
        self.router.set_replicas(self.names)
        self.stats_period = float(stats_period)
        first = self.engines[0]
        cache = first.scheduler.prefix_cache
        self.block_size = first.allocator.block_size
        self.hasher = PrefixHasher(self.block_size, cache.hasher.namespace if cache is not None else "")
        self.step_stats: list = []
        self.record_steps = True
        self.tallies = {name: ReplicaTally() for name in self.names}
        self.decisions: dict[str, Decision] = {}
        self._where: dict[str, int] = {}  # open request id -> replica index
        self._ids = itertools.count()
        self._next_report = [self.clock.now] * len(self.engines)
        self._finishes: list[tuple[float, int, str]] = []  # (virtual finish time, order, request id)
        self._order = itertools.count()

    # --- requests ------------------------------------------------------------------------------------
    def add_request(self, prompt, params: SamplingParams | None = None, request_id: str | None = None,
                    arrival_time: float | None = None, priority: int = 0, user: str = "",
                    cache_salt: str | None = None) -> str:
        """Validate, route and queue a request on one replica; raises ValueError naming the bad field."""
        self._catch_up()
        now = self.clock.now
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self._where:
            raise ValueError(f"request_id: {rid!r} is already in use")
        # Every replica has the same configuration, so the first one validates for all of them.
        request = self.engines[0].make_request(prompt, params, rid, now if arrival_time is None else arrival_time,
                                               priority, user, cache_salt)
        route = RouteRequest(rid, request.num_prompt_tokens, request.params.max_tokens,
                             prompt_block_names(self.hasher, request.cache_salt, request.token_slice,
                                                request.num_prompt_tokens))
        decision = self.router.choose(route)
        index = self.names.index(decision.replica)
        engine = self.engines[index]
        engine.clock.advance_to(now)  # an idle replica starts in the present, a busy one when it is free
        engine.add(request)
        tally = self.tallies[decision.replica]
        tally.requests += 1
        tally.reasons[decision.reason] += 1
        tally.requested_blocks += len(route.block_names)
        tally.expected_blocks += self.router.matched_blocks(decision.replica, route)
        self.router.on_routed(route, decision.replica)
        self.decisions[rid] = decision
        self._where[rid] = index
        return rid

    def abort_request(self, request_id: str) -> RequestOutput | None:
        index = self._where.pop(request_id, None)
        if index is None:
            return None
        self.router.on_finished(request_id)  # the router's own act: it knows at once
        return self.engines[index].abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        """Work is queued somewhere, or a step is still running in virtual time."""
        return self._next_event() is not None

    @property
    def num_waiting(self) -> int:
        return sum(e.num_waiting for e in self.engines)

    @property
    def num_running(self) -> int:
        return sum(e.num_running for e in self.engines)

    @property
    def num_preemptions(self) -> int:
        return sum(e.num_preemptions for e in self.engines)

    def replica_of(self, request_id: str) -> str:
        return self.decisions[request_id].replica

    # --- time ----------------------------------------------------------------------------------------
    def _next_event(self) -> float | None:
        now = self.clock.now
        times = [e.clock() for e in self.engines if e.has_unfinished_requests() or e.clock() > now]
        return min(times) if times else None

    def step(self) -> list[RequestOutput]:
        """Step the replica whose step starts at the next event, then move the wall clock on to the
        event after it: the replay loop sends what arrived by then before the next step, as it does
        for one engine between its steps."""
        self._advance()
        now = self.clock.now
        index = next((i for i, e in enumerate(self.engines) if e.has_unfinished_requests() and e.clock() <= now),
                     None)
        if index is None:  # the event was only the end of a replica's last step
            return []
        engine, name = self.engines[index], self.names[index]
        recorded = len(engine.step_stats)
        outputs = engine.step()
        end = engine.clock()
        for out in outputs:
            if out.finished and self._where.pop(out.request_id, None) is not None:
                heapq.heappush(self._finishes, (end, next(self._order), out.request_id))
                self.tallies[name].hit_blocks += out.num_cached_tokens // self.block_size
        if self.record_steps and len(engine.step_stats) > recorded:
            self.step_stats.append(self._whole(engine.step_stats[-1]))
        self._advance()
        return outputs

    def _advance(self) -> None:
        t = self._next_event()
        if t is not None:
            self.clock.advance_to(t)
        self._catch_up()

    def _whole(self, stats):
        """A replica's step record with the gauges (running, waiting, KV blocks) of all replicas."""
        return dataclasses.replace(
            stats, num_running=self.num_running, num_waiting=self.num_waiting,
            kv_blocks_used=sum(e.allocator.num_used_blocks for e in self.engines),
            kv_blocks_total=sum(e.allocator.num_blocks for e in self.engines),
            kv_blocks_cached=sum(e.allocator.num_cached_blocks for e in self.engines))

    def _catch_up(self) -> None:
        """Deliver what has happened by now: finishes, and the reports that are due from replicas
        at a step boundary (one mid-step reports when its step ends)."""
        now = self.clock.now
        while self._finishes and self._finishes[0][0] <= now:
            self.router.on_finished(heapq.heappop(self._finishes)[2])
        for i, engine in enumerate(self.engines):
            if engine.clock() <= now and now >= self._next_report[i]:
                self.router.report(self.names[i], engine_report(engine))
                self._next_report[i] = now + self.stats_period

    # --- the report ----------------------------------------------------------------------------------
    def routing_summary(self) -> dict:
        """Requests, decisions and prefix blocks per replica: the report's *Replicas* section."""
        def share(hit: int, asked: int) -> float | None:
            return hit / asked if asked else None

        per = []
        for name, engine in zip(self.names, self.engines):
            t = self.tallies[name]
            per.append({"replica": name, "requests": t.requests, "reasons": dict(sorted(t.reasons.items())),
                        "requested_blocks": t.requested_blocks, "expected_blocks": t.expected_blocks,
                        "hit_blocks": t.hit_blocks, "prefix_hit_share": share(t.hit_blocks, t.requested_blocks),
                        "preemptions": engine.num_preemptions})
        asked = sum(t.requested_blocks for t in self.tallies.values())
        return {"replicas": len(self.engines), "routing": self.router.policy,
                "routing_imbalance_tokens": self.router.imbalance_tokens, "routing_stats_period": self.stats_period,
                "requests_per_replica": [p["requests"] for p in per],
                "prefix_hit_share": share(sum(t.hit_blocks for t in self.tallies.values()), asked),
                "expected_share": share(sum(t.expected_blocks for t in self.tallies.values()), asked),
                "per_replica": per}
