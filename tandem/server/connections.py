"""Connection hygiene on top of uvicorn's h11 protocol: a header-read timeout, a connection cap
with an OpenAI-shaped 503, and a way for a response to drop its connection.

uvicorn closes idle keep-alive connections (``timeout_keep_alive``) but has no deadline for a
request's headers: a connection that opens and never sends, or sends a byte now and then,
stayed open for ever (slowloris). Here every request's headers must be complete within
``header_timeout`` seconds, counted from the connection's start or from the request's first
byte; a connection past it is closed, with a 408 when part of a request had come. Beyond
``max_connections`` open connections, each new connection answers its requests with 503 and
``Connection: close`` (uvicorn's own ``limit_concurrency`` answers in plain text).
"""

from __future__ import annotations

import functools
import json
import logging
from dataclasses import dataclass

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from tandem.server.protocol import APIError
from tandem.server.streaming import ABORT_EXTENSION

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ConnectionLimits:
    header_timeout: float
    max_connections: int


def protocol_factory(limits: ConnectionLimits):
    """What uvicorn's ``Config(http=...)`` takes: builds one protocol per connection."""
    return functools.partial(HardenedH11Protocol, limits=limits)


def json_error(status: int, message: str, code: str, extra_headers: list[tuple[bytes, bytes]] = ()) -> tuple:
    body = json.dumps(APIError(status, message, code=code).body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
               (b"connection", b"close"), *extra_headers]
    return headers, body


async def _over_capacity(scope, receive, send) -> None:
    headers, body = json_error(503, "the server is at its connection limit; retry later", "too_many_connections",
                               [(b"retry-after", b"1")])
    await send({"type": "http.response.start", "status": 503, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class HardenedH11Protocol(H11Protocol):
    def __init__(self, *args, limits: ConnectionLimits, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.limits = limits
        self._header_timer = None

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        app = _over_capacity if len(self.connections) > self.limits.max_connections else self.app
        if app is _over_capacity:
            log.info("connection limit of %d reached: refusing a connection's requests",
                        self.limits.max_connections)

        async def with_abort(scope, receive, send) -> None:
            scope.setdefault("extensions", {})[ABORT_EXTENSION] = transport.abort
            await app(scope, receive, send)

        self.app = with_abort
        self._arm()

    def data_received(self, data: bytes) -> None:
        cycle = self.cycle
        if self._header_timer is None and (cycle is None or cycle.response_complete):
            self._arm()  # the first byte of the next request
        super().data_received(data)
        if self.cycle is not cycle:  # its headers are complete
            self._disarm()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._header_timer = self.loop.call_later(self.limits.header_timeout, self._headers_too_slow)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if self.transport.is_closing():
            return
        partial, _ = self.conn.trailing_data
        if partial and self.conn.their_state is h11.IDLE:
            # h11 sends no response before a request: write it raw
            headers, body = json_error(408, f"the request headers did not arrive within "
                                       f"{self.limits.header_timeout:g} s", "request_timeout")
            head = b"".join(k + b": " + v + b"\r\n" for k, v in headers)
            self.transport.write(b"HTTP/1.1 408 Request Timeout\r\n" + head + b"\r\n" + body)
        log.debug("closing a connection whose request headers did not arrive in %g s", self.limits.header_timeout)
        self.transport.close()
