"""Building a swappable part from its registry (policies, fairness orderings) by name."""

from __future__ import annotations

from typing import Any, Callable, Mapping


def make(registry: Mapping[str, Callable[[Any], Any]], field: str, name: str, settings: Any) -> Any:
    """``registry[name](settings)``; an unknown name is a ValueError naming the config field."""
    try:
        factory = registry[name]
    except KeyError:
        raise ValueError(f"{field}: unknown {name!r}; expected one of {', '.join(registry)}") from None
    return factory(settings)
