"""CLI flags derived from the config dataclasses (pdserve/config.py, pdserve/engine_config.py), and configs built back.

Every field made with `setting()` becomes one flag in its dataclass's argument group, with the
field's type, choices, default (shown in --help) and unit; a nested dataclass field gets its
own group. Bounds are checked by the dataclasses themselves: a ConfigError becomes a one-line
usage error naming the flag.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any, TypeVar

from pdserve.commands import CommandError
from pdserve.config import ConfigError

C = TypeVar("C")


def flag_of(field: dataclasses.Field) -> str:
    return field.metadata.get("flag") or "--" + field.name.replace("_", "-")


def dest_of(field: dataclasses.Field) -> str:
    return flag_of(field).removeprefix("--").replace("-", "_")


def add_config_arguments(
    parser: argparse.ArgumentParser, cls: type
) -> dict[type, argparse._ArgumentGroup]:
    """Adds one argument group per dataclass (cls and its nested ones); returns them by class,
    so a command can add its own inputs to the right group."""
    groups: dict[type, argparse._ArgumentGroup] = {}
    group = parser.add_argument_group(cls.cli_group, cls.__doc__.splitlines()[0])
    groups[cls] = group
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[field.name]):
            groups.update(add_config_arguments(parser, hints[field.name]))
        elif field.metadata.get("cli"):
            _add_flag(group, field, hints[field.name])
    return groups


def config_from_args(cls: type[C], args: argparse.Namespace) -> C:
    """The config the flags describe; raises CommandError naming the flag of a bad value."""
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for field in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[field.name]):
            values[field.name] = config_from_args(hints[field.name], args)
        elif field.metadata.get("cli"):
            value = getattr(args, dest_of(field))
            unit = field.metadata["unit"]
            values[field.name] = value * unit if value is not None and unit != 1 else value
    try:
        return cls(**values)
    except ConfigError as e:
        field = next(f for f in dataclasses.fields(cls) if f.name == e.name)
        raise CommandError(f"{flag_of(field)}: {e.reason}") from e


def _add_flag(group: argparse._ArgumentGroup, field: dataclasses.Field, hint: Any) -> None:
    meta = field.metadata
    value_type = _plain_type(hint)
    default = field.default
    if default is not None and meta["unit"] != 1:
        default //= meta["unit"]
    help_text = meta["help"]
    if default is not None:
        help_text = f"{help_text} (default: %(default)s)" if help_text else "(default: %(default)s)"
    if value_type is bool:
        group.add_argument(
            flag_of(field),
            dest=dest_of(field),
            action=argparse.BooleanOptionalAction,  # adds the --no-... form
            default=default,
            help=help_text,
        )
    else:
        group.add_argument(
            flag_of(field),
            dest=dest_of(field),
            type=value_type,
            choices=meta["choices"],
            default=default,
            help=help_text,
        )


def _plain_type(hint: Any) -> type:
    """int | None -> int."""
    if isinstance(hint, types.UnionType):
        kinds = [t for t in typing.get_args(hint) if t is not type(None)]
        return kinds[0]
    return hint
