"""Reading a request body as JSON, with every malformed input answered by a 4xx.

Beyond size (413) and UTF-8, a body is refused (400) when it holds what the parser or the rest
of the server cannot take safely:

- nesting deeper than ``MAX_DEPTH``: measured on the raw bytes before parsing, so a body nested
  100,000 deep costs a few vectorised passes, never a deep recursion;
- a number literal longer than ``MAX_NUMBER_CHARS`` characters (Python refuses to convert
  integers beyond 4,300 digits, and a 64-bit value needs at most 20);
- ``NaN``, ``Infinity`` and ``-Infinity``, which Python's parser accepts but JSON does not;
- a string (a value or a key) that is not valid Unicode text, such as a lone UTF-16 surrogate
  written as the escape ``"\\ud800"``: the tokenizer and the response encoder cannot encode it.

The 400s for a literal or a string name the field's path as the request validation does
(``messages[0].content``, ``stop[1]``). Finding that path walks the parsed body, which happens
only when the parser refused a literal or the raw text holds a surrogate escape at all: a plain
body costs one scan for the depth and the parse itself.
"""

from __future__ import annotations

import asyncio

import json
import re
from typing import Any

import numpy as np
from starlette.requests import Request

from tandem.server.protocol import APIError, bad_request

MAX_DEPTH = 64
"""Deepest nesting of arrays and objects accepted; the API's own bodies need fewer than 6."""

MAX_NUMBER_CHARS = 100
"""Longest number literal accepted, in characters."""

# A string, or an unterminated one up to the end: every quote outside a string starts a match that
# succeeds, and possessive repeats never backtrack, so the substitution is linear in the body.
_STRING = re.compile(rb'"[^"\\]*+(?:\\.[^"\\]*+)*+(?:"|\\?\Z)', re.DOTALL)
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_DEPTH_STEP = np.zeros(256, dtype=np.int8)
_DEPTH_STEP[[ord("["), ord("{")]] = 1
_DEPTH_STEP[[ord("]"), ord("}")]] = -1


class _Refused:
    """What the parser puts in place of a literal it refused, so the walk can name its field."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


def _long(text: str) -> _Refused:
    return _Refused(f"a number literal of {len(text)} characters exceeds the limit of {MAX_NUMBER_CHARS}")


async def read_json(request: Request, limit: int, timeout: float | None = None) -> Any:
    """The body of ``request`` parsed and checked; raises APIError (413 beyond ``limit`` bytes,
    408 if it has not arrived in full within ``timeout`` seconds, else 400) for anything it refuses."""
    return parse(await read_body(request, limit, timeout))


async def read_body(request: Request, limit: int, timeout: float | None = None) -> bytes:
    """The raw body, with read_json's 413 and 408."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"request body of {declared} bytes exceeds the limit of {limit} bytes")

    async def read() -> bytes:
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise APIError(413, f"request body exceeds the limit of {limit} bytes")
            chunks.append(chunk)
        return b"".join(chunks)

    try:
        raw = await asyncio.wait_for(read(), timeout)
    except asyncio.TimeoutError:
        # the rest of the body may still come: the connection cannot carry another request
        raise APIError(408, f"the request body did not arrive within {timeout:g} s", code="request_timeout",
                       headers={"Connection": "close"}) from None
    return raw


def parse(raw: bytes) -> Any:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise bad_request(f"the request body is not valid UTF-8 (byte {exc.start})") from None
    if max_depth(raw) > MAX_DEPTH:
        raise bad_request(f"the request body is nested more than {MAX_DEPTH} levels deep")
    refused = []

    def refuse(reason: _Refused) -> _Refused:
        refused.append(reason)
        return reason

    def parse_int(s: str) -> int | _Refused:
        return refuse(_long(s)) if len(s) > MAX_NUMBER_CHARS else int(s)

    def parse_float(s: str) -> float | _Refused:
        return refuse(_long(s)) if len(s) > MAX_NUMBER_CHARS else float(s)

    try:
        data = json.loads(text, parse_int=parse_int, parse_float=parse_float,
                          parse_constant=lambda s: refuse(_Refused(f"{s} is not valid JSON")))
    except RecursionError:  # unreachable after the depth check; kept so a parser change cannot make it a 500
        raise bad_request(f"the request body is nested more than {MAX_DEPTH} levels deep") from None
    except json.JSONDecodeError as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}") from None
    if refused or _SURROGATE_ESCAPE.search(raw):
        check(data)
    return data


def max_depth(raw: bytes) -> int:
    """The deepest nesting of arrays and objects in ``raw``, brackets inside strings not counted
    (exact for valid JSON; for invalid JSON, exact up to where the parser stops)."""
    if len(raw) <= 2 * MAX_DEPTH:  # too short to be too deep: skip the scan
        return 0
    outside = _STRING.sub(b'""', raw)
    steps = _DEPTH_STEP[np.frombuffer(outside, dtype=np.uint8)]
    return int(np.cumsum(steps, dtype=np.int32).max(initial=0))


def check(data: Any) -> None:
    """Refuse (400 naming the field) a literal the parser refused or a string that is not valid
    Unicode. Iterative; a field's path is built only for the one refused."""
    stack: list[tuple[Any, tuple | None]] = [(data, None)]  # (value, (parent link, key or index))
    while stack:
        value, link = stack.pop()
        if isinstance(value, str):
            _check_text(value, link)
        elif isinstance(value, _Refused):
            _refuse(link, value.reason)
        elif isinstance(value, list):
            if all(type(x) is int for x in value):  # token-id lists: nothing to look into
                continue
            stack.extend((value[i], (link, i)) for i in range(len(value) - 1, -1, -1))  # the first bad one is named
        elif isinstance(value, dict):
            for key in value:
                _check_text(key, (link, key))
            stack.extend((value[k], (link, k)) for k in reversed(value))


def _check_text(text: str, link: tuple | None) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        _refuse(link, f"the string holds an unpaired UTF-16 surrogate (U+{ord(text[exc.start]):04X}) "
                      f"at character {exc.start}")


def _path(link: tuple | None) -> str:
    parts: list[str] = []
    while link is not None:
        link, key = link
        parts.append(f"[{key}]" if isinstance(key, int) else f".{key}")
    path = "".join(reversed(parts)).removeprefix(".")
    # a key can be the bad string: the answer must still encode
    return path.encode("utf-8", "backslashreplace").decode("utf-8")


def _refuse(link: tuple | None, reason: str) -> None:
    path = _path(link)
    if path:
        raise bad_request(f"{path}: {reason}", path)
    raise bad_request(f"the request body: {reason}")
