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


def add_engine_args(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    hints = {}
    for section in EngineConfig.SECTIONS:
        cls = typing.get_type_hints(EngineConfig)[section]
        group = parser.add_argument_group(f"{section} options")
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.name in skip:
                continue
            flag = "--" + f.name.replace("_", "-")
            default = f.default if f.default is not dataclasses.MISSING else None
            group.add_argument(
                flag,
                dest=f.name,
                type=_arg_type(hints[f.name]),
                default=default,
                choices=f.metadata.get("choices"),
                help=f.metadata.get("help", ""),
            )


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    names = {
        f.name
        for section in EngineConfig.SECTIONS
        for f in dataclasses.fields(typing.get_type_hints(EngineConfig)[section])
    }
    return EngineConfig.from_kwargs(**{k: v for k, v in vars(args).items() if k in names})
