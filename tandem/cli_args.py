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


def add_dataclass_args(parser: argparse.ArgumentParser, cls: type, title: str) -> None:
    group = parser.add_argument_group(title)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        group.add_argument(
            "--" + f.name.replace("_", "-"),
            dest=f.name,
            type=_arg_type(hints[f.name]),
            default=f.default if f.default is not dataclasses.MISSING else None,
            choices=f.metadata.get("choices"),
            help=f.metadata.get("help", ""),
        )


def dataclass_from_args(cls: type, args: argparse.Namespace):
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})


def _sections() -> list[tuple[str, type]]:
    hints = typing.get_type_hints(EngineConfig)
    return [(name, hints[name]) for name in EngineConfig.SECTIONS]


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    for name, cls in _sections():
        add_dataclass_args(parser, cls, f"{name} options")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    config = EngineConfig(**{name: dataclass_from_args(cls, args) for name, cls in _sections()})
    config.validate()
    return config
