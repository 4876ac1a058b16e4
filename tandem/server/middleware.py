"""The last line of defence: an exception no route handled becomes a 500 in OpenAI's error shape
and the connection stays usable.

Starlette's own ServerErrorMiddleware calls the exception handler and then re-raises, and uvicorn
answers a re-raised exception by dropping the connection, so a keep-alive client's next pooled
request fails too. This plain ASGI middleware sits inside it and never re-raises: before the
response has started it sends the error JSON; after, it ends the body properly (a streamed SSE
response gets an error event and ``[DONE]`` first), so the connection can carry the next request.
"""

from __future__ import annotations

import json
import logging

from tandem.server.protocol import APIError

log = logging.getLogger(__name__)


class ErrorGuard:
    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = ended = False
        event_stream = False

        async def tracking_send(message) -> None:
            nonlocal started, ended, event_stream
            if message["type"] == "http.response.start":
                started = True
                content_type = dict(message.get("headers") or []).get(b"content-type", b"")
                event_stream = content_type.startswith(b"text/event-stream")
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                ended = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as exc:  # noqa: BLE001 - this is the one place that must catch everything
            log.exception("unhandled error in %s %s", scope.get("method"), scope.get("path"))
            message = f"internal error: {type(exc).__name__}: {exc}"
            try:
                if not started:
                    await _send_json(send, APIError(500, message))
                elif not ended:
                    tail = b""
                    if event_stream:
                        tail = (b"data: " + json.dumps(APIError(500, message).body()).encode() + b"\n\n"
                                b"data: [DONE]\n\n")
                    await send({"type": "http.response.body", "body": tail, "more_body": False})
            except OSError:  # the client is gone as well; nothing left to tell it
                pass


async def _send_json(send, err: APIError) -> None:
    body = json.dumps(err.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in err.headers.items()]
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})
