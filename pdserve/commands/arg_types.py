"""argparse types for bounded numbers: a value out of range is a usage error naming the flag
(argparse adds it), never a traceback or a server round trip."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from pdserve.config_fields import bound_violation

INT32_MAX = (1 << 31) - 1
UINT32_MAX = (1 << 32) - 1
UINT64_MAX = (1 << 64) - 1


def bounded(
    kind: type,
    *,
    minimum: float | None = None,
    maximum: float | None = None,
    above: float | None = None,
) -> Callable[[str], float]:
    """An argparse `type` parsing `kind` within [minimum, maximum] (and > above)."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"not a{'n int' if kind is int else ' number'}: {text!r}"
            ) from None
        problem = bound_violation(value, minimum, maximum, above)
        if problem:
            raise argparse.ArgumentTypeError(problem)
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its messages
    return parse
