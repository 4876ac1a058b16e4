"""Configuration strings of `tandem compare` and `tandem tune`: ``KEY=VALUE[,KEY=VALUE]`` over the
fields of SchedulerConfig, each value read as its field's type, so a knob added to the config
dataclass is a compare/tune key without touching this module; plus the replica keys
(``ROUTING_KEYS``, fields of ServerConfig), which only the simulator and launched servers apply."""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any

from tandem.config import SchedulerConfig, ServerConfig

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


ROUTING_KEYS = ("replicas", "routing", "routing_imbalance_tokens", "routing_stats_period")
"""Keys of a replicated deployment, typed and checked as ServerConfig's fields (`tandem serve`'s
flags of those names): N engines behind a router, which one in-process engine is not."""


def keys(fields_of: type = SchedulerConfig) -> set[str]:
    names = {f.name for f in dataclasses.fields(fields_of)}
    return (names | set(ROUTING_KEYS)) if fields_of is SchedulerConfig else names


def split_routing(overrides: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the scheduler's overrides, the replica keys')."""
    sched = {k: v for k, v in overrides.items() if k not in ROUTING_KEYS}
    return sched, {k: v for k, v in overrides.items() if k in ROUTING_KEYS}


def refuse_routing(overrides: dict[str, Any]) -> None:
    """The in-process engine is one replica: a replica key there is an error naming it."""
    for key in ROUTING_KEYS:
        if key in overrides:
            raise ValueError(f"{key}: the in-process engine is one replica; replicas and routing apply to "
                             f"`tandem simulate` and to launched servers (`tandem serve --{key.replace('_', '-')}`)")


def _kinds(fields_of: type, key: str) -> tuple[set[type], bool]:
    """(the non-None types the field's annotation allows, whether None is allowed)."""
    hint = typing.get_type_hints(fields_of)[key]
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = set(typing.get_args(hint))
    else:
        args = {hint}
    return args - {type(None)}, type(None) in args


def parse_value(key: str, text: str, fields_of: type = SchedulerConfig) -> Any:
    """``text`` as the type of field ``key``; raises ValueError naming the key."""
    kinds, optional = _kinds(fields_of, key)
    text = text.strip()
    if optional and text.lower() in ("", "none"):
        return None
    if str in kinds:
        return text
    if bool in kinds:
        if text.lower() in _TRUE + _FALSE:
            return text.lower() in _TRUE
        raise ValueError(f"{key}: expected true or false, got {text!r}")
    if int in kinds:
        try:
            return int(text)
        except ValueError:
            if float not in kinds:
                raise ValueError(f"{key}: expected an integer, got {text!r}") from None
    if float in kinds:
        try:
            value = float(text)
        except ValueError:
            raise ValueError(f"{key}: expected a number, got {text!r}") from None
        if math.isnan(value):
            raise ValueError(f"{key}: expected a number, got {text!r}")
        return value
    raise ValueError(f"{key}: cannot be set from a configuration string")


def parse_overrides(text: str, fields_of: type = SchedulerConfig) -> dict[str, Any]:
    """``"policy=chunked,max_num_batched_tokens=256"`` -> typed overrides, validated together."""
    known = keys(fields_of)
    overrides: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, eq, value = part.partition("=")
        key = key.strip().replace("-", "_")
        if not eq or key not in known:
            raise ValueError(f"configs: {part!r} is not KEY=VALUE with KEY in {', '.join(sorted(known))}")
        typed_by = ServerConfig if key in ROUTING_KEYS and fields_of is SchedulerConfig else fields_of
        overrides[key] = parse_value(key, value, typed_by)
    own, routing = split_routing(overrides) if fields_of is SchedulerConfig else (overrides, {})
    config = fields_of(**own)
    if hasattr(config, "validate"):
        config.validate()
    if routing:
        ServerConfig(**routing).validate()
    return overrides
