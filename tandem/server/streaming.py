"""A streaming response that gives up on a client that stopped reading.

The server's ``send`` blocks once the socket's buffers are full (uvicorn's flow control), so a
client that never reads would otherwise hold its request, its KV blocks and a batch slot until
the request finished. When one send blocks for more than ``write_timeout`` seconds the body
iterator is closed, which aborts the engine requests behind it (``fanout.merged_outputs``), and
the connection is dropped: nothing more can be said on it.
"""

from __future__ import annotations

import asyncio
import logging

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

log = logging.getLogger(__name__)

ABORT_EXTENSION = "tandem.abort_connection"
"""Scope extension our HTTP protocol (``connections.py``) sets: drops the connection at once."""


class WriteStalled(Exception):
    """The client took no data for ``write_timeout`` seconds (raised where the server offers no
    way to drop the connection)."""


class GuardedStreamingResponse(StreamingResponse):
    def __init__(self, *args, write_timeout: float, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.write_timeout = write_timeout
        self._scope: Scope | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self._scope = scope
        await super().__call__(scope, receive, send)

    async def stream_response(self, send: Send) -> None:
        try:
            await self._send(send, {"type": "http.response.start", "status": self.status_code,
                                    "headers": self.raw_headers})
            async for chunk in self.body_iterator:
                if not isinstance(chunk, (bytes, memoryview)):
                    chunk = chunk.encode(self.charset)
                await self._send(send, {"type": "http.response.body", "body": chunk, "more_body": True})
            await self._send(send, {"type": "http.response.body", "body": b"", "more_body": False})
        except _Stall:
            await self._stalled()

    async def _send(self, send: Send, message: dict) -> None:
        try:
            async with asyncio.timeout(self.write_timeout):
                await send(message)
        except TimeoutError:
            raise _Stall from None

    async def _stalled(self) -> None:
        await self.body_iterator.aclose()  # type: ignore[attr-defined]  # aborts the requests
        log.warning("a stream's client took no data for %g s: its request was aborted and its connection closed",
                    self.write_timeout)
        abort = ((self._scope or {}).get("extensions") or {}).get(ABORT_EXTENSION)
        if abort is None:
            raise WriteStalled(f"the client took no data for {self.write_timeout:g} s")
        abort()
        await asyncio.sleep(0)  # the server sees the connection lost before this response returns


class _Stall(Exception):
    pass
