"""What a web page in the user's browser could otherwise do to a key-less server: two checks as
one plain ASGI middleware.

- Content type: a page may POST ``text/plain`` or form bodies cross-origin without a CORS
  preflight, so a POST whose Content-Type is present and not JSON (``application/json``, with any
  parameters, or ``application/*+json``) is refused with 415. A POST without the header is read
  as JSON, as vLLM does (a browser always sends one).
- Host: DNS rebinding points a foreign name at 127.0.0.1, so a server bound to a loopback address
  accepts only ``Host`` values naming loopback (``localhost``, ``127.0.0.1``, ``[::1]``, any port)
  unless ``--allowed-hosts`` lists the names to accept; a server bound elsewhere accepts any
  host unless the list is given. ``*`` in the list accepts any. Others get 400 (``invalid_host``).
"""

from __future__ import annotations

import ipaddress
import json

from tandem.server.protocol import APIError

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "[::1]")


def is_loopback(host: str) -> bool:
    if host.strip("[]").lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def host_name(header: str) -> str:
    """``Host`` header -> the name without its port: 'a:80' -> 'a', '[::1]:80' -> '[::1]'."""
    header = header.strip().lower()
    if header.startswith("["):
        end = header.find("]")
        return header[: end + 1] if end != -1 else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


def allowed_host_names(bind_host: str, allowed_hosts) -> frozenset[str] | None:
    """The names a request's Host may carry; None accepts any."""
    if allowed_hosts:
        names = frozenset(host_name(h) for h in allowed_hosts)
        return None if "*" in names else names
    return frozenset(LOOPBACK_NAMES) if is_loopback(bind_host) else None


def is_json_type(value: bytes) -> bool:
    media = value.split(b";", 1)[0].strip().lower()
    return media == b"application/json" or (media.startswith(b"application/") and media.endswith(b"+json"))


class BrowserGuard:
    def __init__(self, app, bind_host: str, allowed_hosts=()) -> None:
        self.app = app
        self.hosts = allowed_host_names(bind_host, allowed_hosts)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            err = self.check(scope)
            if err is not None:
                body = json.dumps(err.body()).encode()
                await send({"type": "http.response.start", "status": err.status, "headers": [
                    (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)

    def check(self, scope) -> APIError | None:
        headers = dict(scope["headers"])
        host = headers.get(b"host")
        # a request without Host (HTTP/1.0) is no browser's: DNS rebinding needs the header
        if self.hosts is not None and host is not None:
            name = host_name(host.decode("latin-1"))
            if name not in self.hosts:
                return APIError(400, f"Host: {name!r} is not served here (accepted: {', '.join(sorted(self.hosts))}; "
                                "see --allowed-hosts)", param="Host", code="invalid_host")
        if scope["method"] == "POST":
            ctype = headers.get(b"content-type")
            if ctype is not None and not is_json_type(ctype):
                return APIError(415, f"Content-Type: request bodies must be application/json, got "
                                f"{ctype.decode('latin-1')!r}", param="Content-Type", type_="invalid_request_error",
                                code="unsupported_media_type")
        return None
