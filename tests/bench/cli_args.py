"""Arguments of a bench command as its own parser reads them, for tests that call `run`."""

from __future__ import annotations

import argparse
from types import ModuleType


def bench_args(bench: ModuleType, **overrides) -> argparse.Namespace:
    """`bench`'s defaults with `overrides` given as flags (name_with_underscores=value)."""
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return parser.parse_args([f"--{k.replace('_', '-')}={v}" for k, v in overrides.items()])
