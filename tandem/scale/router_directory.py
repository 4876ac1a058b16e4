"""The router's process-local state: the routers Ray built in this process, and their counters.

Ray Serve pickles a request router's module by value when it ships the class, so state kept in
``ray_router.py`` itself would be a copy per router; here, imported by name, it is the one the
ingress in the same process reads (``/replicas``, pinned ``/metrics`` calls, the router's series)."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter

ROUTERS: dict[str, Any] = {}
"""Key (``request_router_kwargs['key']``) -> the ``TandemRequestRouter`` Ray built in this process."""
REGISTRY = CollectorRegistry()
ROUTED = Counter("tandem:router_requests", "Generation requests the router sent, counted when they end, by "
                 "replica and the reason it was chosen (prefix, prefix-overloaded, least-loaded, round-robin; "
                 "fallback: the first choice refused)",
                 ["policy", "replica", "reason"], registry=REGISTRY)
MATCHED = Counter("tandem:router_prefix_blocks_matched", "Prompt blocks the chosen replica held or was sent "
                  "before (prefix-hit share = matched / requested)", ["replica"], registry=REGISTRY)
REQUESTED = Counter("tandem:router_prefix_blocks_requested", "Full prompt blocks of routed requests, by the "
                    "replica they went to", ["replica"], registry=REGISTRY)

