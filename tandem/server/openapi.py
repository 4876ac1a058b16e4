"""The request bodies in ``/openapi.json``. The routes read the raw request (to bound its size and
parse it themselves), so FastAPI cannot see their pydantic models; ``request_body(Model)`` is the
``requestBody`` to give a route decorator's ``openapi_extra``. Pydantic's ``$defs`` are inlined so
each body's schema stands alone: a client generator or a schema fuzzer reads it without resolving
references into a document that has no ``$defs``."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel


def request_body(model: type[BaseModel]) -> dict[str, Any]:
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})
    return {"requestBody": {"required": True,
                            "content": {"application/json": {"schema": _inline(schema, defs)}}}}


def _inline(node: Any, defs: dict[str, Any]) -> Any:
    # the request models are not recursive, so inlining ends
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/$defs/"):
            rest = {k: v for k, v in node.items() if k != "$ref"}
            return {**_inline(defs[ref.rsplit("/", 1)[1]], defs), **rest}
        return {k: _inline(v, defs) for k, v in node.items()}
    if isinstance(node, list):
        return [_inline(v, defs) for v in node]
    return node
