"""What the ingress hands a replica: the HTTP request itself, as data, plus what routing needs.

The replica runs the very app a single-process server runs on it (``asgi_bridge.py``), so
validation, errors, auth, limits and streaming are the single-process server's by construction;
the ingress only routes."""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.core.routing import RouteRequest


@dataclass
class Forwarded:
    method: str
    path: str
    query_string: bytes = b""
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    body: bytes = b""
    client: tuple[str, int] | None = None
    route: RouteRequest | None = None
    """What the router weighs; None for requests that generate nothing (any replica will do)."""


@dataclass(frozen=True)
class ResponseStart:
    status: int
    headers: list[tuple[bytes, bytes]]


@dataclass(frozen=True)
class Pinned:
    """A call for one replica by name (its metrics, its description), not for whichever the
    policy picks."""
    replica: str
