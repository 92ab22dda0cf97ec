"""Arguments of a bench command as its own parser reads them, for tests that call `run`."""

from __future__ import annotations

import argparse
from types import ModuleType


def bench_args(bench: ModuleType, **overrides) -> argparse.Namespace:
    """`bench`'s defaults with `overrides` given as flags (name_with_underscores=value; True:
    a switch given alone)."""
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    flags = [
        f"--{k.replace('_', '-')}" + ("" if v is True else f"={v}") for k, v in overrides.items()
    ]
    return parser.parse_args(flags)
