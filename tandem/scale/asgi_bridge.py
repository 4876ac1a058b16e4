"""Runs an ASGI app on a ``Forwarded`` request and yields its response as it is sent: a
``ResponseStart``, then body bytes.

Body pieces that are ready together are joined into one item, so a step's tokens for one stream
cost one Ray stream item, not one per server-sent event. When the consumer goes away (the ingress
cancels the call because its client disconnected, or the stream is closed) the app's ``receive``
answers ``http.disconnect``, which is how the app learns of a disconnect behind uvicorn too, so it
aborts the request and frees its KV."""

from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator

from tandem.scale.forward import Forwarded, ResponseStart

END = object()


async def run_asgi(app, fwd: Forwarded) -> AsyncIterator[ResponseStart | bytes]:
    sent: asyncio.Queue = asyncio.Queue()
    gone = asyncio.Event()
    body_given = False

    async def receive() -> dict:
        nonlocal body_given
        if not body_given:
            body_given = True
            return {"type": "http.request", "body": fwd.body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        if gone.is_set():
            raise OSError("the ingress closed this response")
        sent.put_nowait(message)

    scope = {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
        "method": fwd.method, "scheme": "http", "path": fwd.path, "raw_path": fwd.path.encode(),
        "query_string": fwd.query_string, "root_path": "", "headers": list(fwd.headers),
        "client": fwd.client, "server": None, "extensions": {},
    }

    async def run() -> None:
        try:
            await app(scope, receive, send)
        finally:
            sent.put_nowait(END)

    task = asyncio.ensure_future(run())
    try:
        while True:
            message = await sent.get()
            if message is END:
                break
            if message["type"] == "http.response.start":
                yield ResponseStart(message["status"], list(message.get("headers", [])))
                continue
            pieces, done = [message.get("body", b"")], not message.get("more_body", False)
            while not done and not sent.empty():
                nxt = sent.get_nowait()
                if nxt is END:
                    done = True
                    break
                pieces.append(nxt.get("body", b""))
                done = not nxt.get("more_body", False)
            chunk = b"".join(pieces)
            if chunk:
                yield chunk
            if done:
                break
    finally:
        gone.set()
        with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError, Exception):
            await asyncio.wait_for(asyncio.shield(task), timeout=5)
        if not task.done():
            task.cancel()
