"""Validation of the simulator's JSON files (cost profiles, device descriptions): each field is
checked against its rule and an error names the file and the field's path, e.g.
``profile h100.json: device.memory_bytes_per_s: must be a number > 0, got 'fast'``. Hand-written
because ``jsonschema`` is a test-only dependency."""

from __future__ import annotations

import math
from typing import Any, Callable

Rule = Callable[[str, Any], None]
"""(field path, value) -> None, or raises ValueError naming the path."""


class SchemaError(ValueError):
    pass


def number(minimum: float = 0.0, strict: bool = False, maximum: float | None = None) -> Rule:
    def check(path: str, v: Any) -> None:
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        ok = ok and (v > minimum if strict else v >= minimum) and (maximum is None or v <= maximum)
        if not ok:
            bound = f"{'>' if strict else '>='} {minimum:g}" + (f" and <= {maximum:g}" if maximum is not None else "")
            raise SchemaError(f"{path}: must be a number {bound}, got {v!r}")
    return check


def integer(minimum: int = 1) -> Rule:
    def check(path: str, v: Any) -> None:
        if not isinstance(v, int) or isinstance(v, bool) or v < minimum:
            raise SchemaError(f"{path}: must be an integer >= {minimum}, got {v!r}")
    return check


def boolean() -> Rule:
    def check(path: str, v: Any) -> None:
        if not isinstance(v, bool):
            raise SchemaError(f"{path}: must be true or false, got {v!r}")
    return check


def text(choices: tuple[str, ...] | None = None) -> Rule:
    def check(path: str, v: Any) -> None:
        if not isinstance(v, str) or (choices is not None and v not in choices):
            want = f"one of {', '.join(choices)}" if choices else "a string"
            raise SchemaError(f"{path}: must be {want}, got {v!r}")
    return check


def mapping(fields: dict[str, tuple[Rule, bool]], extra: bool = False) -> Rule:
    """An object whose keys are ``fields`` (rule, required); unknown keys are refused unless
    ``extra`` (a typo should not silently fall back to a default)."""
    def check(path: str, v: Any) -> None:
        if not isinstance(v, dict):
            raise SchemaError(f"{path or 'the file'}: must be a JSON object, got {type(v).__name__}")
        prefix = f"{path}." if path else ""
        for key, (rule, required) in fields.items():
            if key in v:
                rule(prefix + key, v[key])
            elif required:
                raise SchemaError(f"{prefix}{key}: is required")
        unknown = sorted(k for k in v if k not in fields and not k.startswith("_"))
        if unknown and not extra:
            raise SchemaError(f"{prefix}{unknown[0]}: unknown field (known: {', '.join(fields)})")
    return check


def number_map(minimum: float = 0.0, strict: bool = True) -> Rule:
    """An object of name -> number (peak FLOP/s per dtype)."""
    each = number(minimum, strict)

    def check(path: str, v: Any) -> None:
        if not isinstance(v, dict) or not v:
            raise SchemaError(f"{path}: must be a non-empty JSON object of numbers, got {v!r}")
        for key, value in v.items():
            each(f"{path}.{key}", value)
    return check


def name_or(rule: Rule, what: str) -> Rule:
    """A string (a shipped name or a file path, resolved later) or an inline value ``rule`` checks."""
    def check(path: str, v: Any) -> None:
        if isinstance(v, str):
            if not v:
                raise SchemaError(f"{path}: must be {what}, got an empty string")
            return
        if not isinstance(v, dict):
            raise SchemaError(f"{path}: must be {what}, got {v!r}")
        rule(path, v)
    return check


def validate(rule: Rule, data: Any, source: str) -> None:
    try:
        rule("", data)
    except SchemaError as exc:
        raise SchemaError(f"{source}: {exc}") from None
