"""Reading a request body as JSON, with every malformed input answered by a 4xx.

Beyond size (413) and UTF-8, a body is refused (400) when it holds what the parser or the rest
of the server cannot take safely:

- nesting deeper than ``MAX_DEPTH`` (the parser itself stops at Python's recursion limit, which
  is caught, so a body nested 100,000 deep costs one short failed parse, never a crash);
- a number literal longer than ``MAX_NUMBER_CHARS`` characters (Python refuses to convert
  integers beyond 4,300 digits, and a 64-bit value needs at most 20);
- ``NaN``, ``Infinity`` and ``-Infinity``, which Python's parser accepts but JSON does not;
- a string (a value or a key) that is not valid Unicode text, such as a lone UTF-16 surrogate
  written as the escape ``"\\ud800"``: the tokenizer and the response encoder cannot encode it.

The 400s name the field's path as the request validation does (``messages[0].content``,
``stop[1]``).
"""

from __future__ import annotations

import json
from typing import Any

from starlette.requests import Request

from tandem.server.protocol import APIError, bad_request

MAX_DEPTH = 64
"""Deepest nesting of arrays and objects accepted; the API's own bodies need fewer than 6."""

MAX_NUMBER_CHARS = 100
"""Longest number literal accepted, in characters."""


class _Refused:
    """What the parser puts in place of a literal it refused, so the walk can name its field."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


def _parse_int(text: str) -> int | _Refused:
    if len(text) > MAX_NUMBER_CHARS:
        return _Refused(f"a number literal of {len(text)} characters exceeds the limit of {MAX_NUMBER_CHARS}")
    return int(text)


def _parse_float(text: str) -> float | _Refused:
    if len(text) > MAX_NUMBER_CHARS:
        return _Refused(f"a number literal of {len(text)} characters exceeds the limit of {MAX_NUMBER_CHARS}")
    return float(text)


def _parse_constant(text: str) -> _Refused:
    return _Refused(f"{text} is not valid JSON")


async def read_json(request: Request, limit: int) -> Any:
    """The body of ``request`` parsed and checked; raises APIError (413 beyond ``limit`` bytes,
    else 400) for anything it refuses."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"request body of {declared} bytes exceeds the limit of {limit} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"request body exceeds the limit of {limit} bytes")
        chunks.append(chunk)
    return parse(b"".join(chunks))


def parse(raw: bytes) -> Any:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise bad_request(f"the request body is not valid UTF-8 (byte {exc.start})") from None
    try:
        data = json.loads(text, parse_int=_parse_int, parse_float=_parse_float, parse_constant=_parse_constant)
    except RecursionError:
        raise bad_request(f"the request body is nested more than {MAX_DEPTH} levels deep") from None
    except json.JSONDecodeError as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}") from None
    check(data)
    return data


def check(data: Any) -> None:
    """Refuse (400 naming the field) too deep a nesting, a refused literal or a string that is
    not valid Unicode. Iterative, so its cost is one visit per value whatever the shape."""
    stack: list[tuple[Any, str, int]] = [(data, "", 0)]
    while stack:
        value, path, depth = stack.pop()
        if isinstance(value, str):
            _check_text(value, path)
        elif isinstance(value, _Refused):
            _refuse(path, value.reason)
        elif isinstance(value, list):
            if depth >= MAX_DEPTH:
                _refuse(path, f"nested more than {MAX_DEPTH} levels deep")
            if all(type(x) is int for x in value):  # token-id lists: nothing to look into
                continue
            stack.extend((x, f"{path}[{i}]", depth + 1) for i, x in enumerate(value))
        elif isinstance(value, dict):
            if depth >= MAX_DEPTH:
                _refuse(path, f"nested more than {MAX_DEPTH} levels deep")
            for key, x in value.items():
                child = f"{path}.{key}" if path else key
                _check_text(key, child)
                stack.append((x, child, depth + 1))


def _check_text(text: str, path: str) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        _refuse(path, f"the string holds an unpaired UTF-16 surrogate (U+{ord(text[exc.start]):04X}) "
                      f"at character {exc.start}")


def _refuse(path: str, reason: str) -> None:
    # a key can be the bad string: the answer must still encode
    path = path.encode("utf-8", "backslashreplace").decode("utf-8")
    if path:
        raise bad_request(f"{path}: {reason}", path)
    raise bad_request(f"the request body: {reason}")
