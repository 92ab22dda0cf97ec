"""How a setting is declared and checked: `setting()` puts the default, help text, CLI flag and
bounds on a dataclass field; `check_fields` enforces them from `__post_init__`;
pdserve/commands/config_args.py turns the same metadata into argparse flags.
"""

from __future__ import annotations

import dataclasses
from dataclasses import MISSING, field
from typing import Any

MAX_PORT = 65535
MiB = 1 << 20  # a setting's unit for sizes given in MiB on the command line


class ConfigError(ValueError):
    """A setting out of its bounds; `owner.name` is the field, `reason` says what is wrong."""

    def __init__(self, owner: str, name: str, reason: str) -> None:
        super().__init__(f"{owner}.{name}: {reason}")
        self.owner, self.name, self.reason = owner, name, reason


def setting(
    default: Any = MISSING,
    help: str = "",
    *,
    flag: str | None = None,
    choices: tuple | None = None,
    minimum: float | None = None,
    maximum: float | None = None,
    above: float | None = None,
    unit: int = 1,
    cli: bool = True,
    default_factory: Any = MISSING,
) -> Any:
    """A dataclass field with what the CLI and validation need to know about it.

    flag: the CLI flag (default: --field-name); cli=False keeps it off the command line.
    minimum/maximum: inclusive bounds; above: exclusive lower bound (None values are exempt).
    unit: the flag takes the value in this many units of the field (e.g. MiB for a byte size).
    """
    metadata = {
        "help": help,
        "flag": flag,
        "choices": choices,
        "minimum": minimum,
        "maximum": maximum,
        "above": above,
        "unit": unit,
        "cli": cli,
    }
    return field(default=default, default_factory=default_factory, metadata=metadata)


def bound_violation(
    value: float,
    minimum: float | None = None,
    maximum: float | None = None,
    above: float | None = None,
) -> str | None:
    """What is wrong with `value` against inclusive minimum/maximum and exclusive `above`."""
    if minimum is not None and value < minimum:
        return f"must be at least {minimum}, got {value}"
    if maximum is not None and value > maximum:
        return f"must be at most {maximum}, got {value}"
    if above is not None and value <= above:
        return f"must be more than {above}, got {value}"
    return None


def check_fields(config: Any) -> None:
    """Raises ConfigError for the first field outside its choices or bounds."""
    owner = type(config).__name__
    for f in dataclasses.fields(config):
        value, meta = getattr(config, f.name), f.metadata
        if value is None or isinstance(value, bool) or not meta:
            continue
        if meta["choices"] and value not in meta["choices"]:
            raise ConfigError(owner, f.name, f"must be one of {', '.join(meta['choices'])}")
        problem = bound_violation(value, meta["minimum"], meta["maximum"], meta["above"])
        if problem:
            raise ConfigError(owner, f.name, problem)


def port_setting(default: int | None, help: str, *, flag: str | None = None) -> Any:
    return setting(default, help, flag=flag, minimum=0, maximum=MAX_PORT)
