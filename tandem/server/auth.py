"""Bearer-key check for the /v1 routes and /tokenize, /detokenize (which cost CPU and reveal the
vocabulary), as plain ASGI middleware."""

from __future__ import annotations

import hmac

from fastapi.responses import JSONResponse

from tandem.server.protocol import APIError
from tandem.server.state import ServerState


class BearerAuth:
    """Plain ASGI middleware (not BaseHTTPMiddleware, which hides client disconnects from the
    routes): every guarded route needs ``Authorization: Bearer <key>``."""

    def __init__(self, app, state: ServerState) -> None:
        self.app = app
        self.state = state
        self.expected = f"Bearer {state.api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and _guarded(scope["path"]):
            auth = dict(scope["headers"]).get(b"authorization", b"")
            # constant time, so response timing does not leak how much of a guessed key was right
            if not hmac.compare_digest(auth, self.expected):
                self.state.metrics.reject("unauthorized")
                err = APIError(401, "missing or wrong API key (expected 'Authorization: Bearer <key>')",
                               code="invalid_api_key")
                await JSONResponse(err.body(), status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _guarded(path: str) -> bool:
    return path.startswith("/v1") or path in ("/tokenize", "/detokenize")
