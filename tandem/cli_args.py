"""Command-line flags derived from the config dataclasses, so help and defaults live in one place.

A field ``max_num_batched_tokens`` becomes ``--max-num-batched-tokens``; its type, default,
choices and help text come from the dataclass.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing

from tandem.config import EngineConfig


def _arg_type(tp) -> type:
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    base = args[0] if args else tp
    return base if base in (int, float, str) else str


def _element_type(tp) -> type:
    """``Sequence[int]`` -> int (the type of one value of a list-valued flag)."""
    args = typing.get_args(tp)
    return args[0] if args and args[0] in (int, float, str) else str


def add_dataclass_args(parser: argparse.ArgumentParser, cls: type, title: str, skip: tuple[str, ...] = (),
                       defaults: dict[str, object] | None = None) -> None:
    """One flag per field of ``cls``; ``defaults`` replaces some fields' defaults (a front end's
    documented difference, e.g. ``tandem.core.sampling_params.CLI_DEFAULTS``)."""
    group = parser.add_argument_group(title)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        help_text = f.metadata.get("help", "")
        if defaults and f.name in defaults:
            default = defaults[f.name]
        elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            default = f.default_factory()  # type: ignore[misc]
        else:
            default = f.default
        if hints[f.name] is bool:
            # a switch that is on by default also needs its off form (--no-...)
            action = argparse.BooleanOptionalAction if default else "store_true"
            group.add_argument(flag, dest=f.name, action=action, default=default, help=help_text)
        elif f.metadata.get("action") == "append":
            group.add_argument(flag, dest=f.name, action="append", default=list(default),
                               type=_element_type(hints[f.name]), help=help_text)
        elif "nargs" in f.metadata:
            group.add_argument(flag, dest=f.name, nargs=f.metadata["nargs"], default=default,
                               type=_element_type(hints[f.name]), help=help_text)
        else:
            group.add_argument(
                flag,
                dest=f.name,
                type=_arg_type(hints[f.name]),
                default=default,
                choices=f.metadata.get("choices"),
                help=help_text,
            )


def dataclass_from_args(cls: type, args: argparse.Namespace, **override):
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
    values.update(override)
    for f in dataclasses.fields(cls):  # list-valued flags arrive as lists
        if isinstance(values.get(f.name), list):
            values[f.name] = tuple(values[f.name])
    return cls(**values)


def _sections() -> list[tuple[str, type]]:
    hints = typing.get_type_hints(EngineConfig)
    return [(name, hints[name]) for name in EngineConfig.SECTIONS]


def add_engine_args(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    for name, cls in _sections():
        add_dataclass_args(parser, cls, f"{name} options", skip)


def engine_config_from_args(args: argparse.Namespace, **override) -> EngineConfig:
    config = EngineConfig(**{
        name: dataclass_from_args(cls, args, **{k: v for k, v in override.items()
                                                if k in {f.name for f in dataclasses.fields(cls)}})
        for name, cls in _sections()
    })
    config.validate()
    return config
