"""Fits a `LinearTiming` profile to measured engine steps (issue 14 point 2b: a real engine's
per-step costs become a `--sim-profile` JSON file).

Least squares of step seconds on (1, prefill tokens, decode sequences, context tokens), kept
non-negative: a feature whose coefficient comes out negative is dropped (its coefficient is 0)
and the rest refitted, until all are non-negative (an active-set NNLS, enough for 4 features).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict

from pdserve.sim.timing import LinearTiming, StepWork

FEATURES = ("step_s", "prefill_token_s", "decode_seq_s", "context_token_s")


def features(work: StepWork) -> list[float]:
    return [1.0, work.prefill_tokens, work.decode_seqs, work.context_tokens]


def fit_linear(samples: Iterable[tuple[StepWork, float]]) -> LinearTiming:
    """The non-negative linear step-cost model closest (least squares) to the samples of
    (step work, measured seconds). ValueError when the samples cannot determine it."""
    rows = [(features(work), seconds) for work, seconds in samples]
    active = list(range(len(FEATURES)))
    while True:
        solution = _least_squares(rows, active)
        negative = [i for i, value in zip(active, solution, strict=True) if value < 0]
        if not negative:
            break
        active = [i for i in active if i not in negative]
    coefficients = dict.fromkeys(FEATURES, 0.0)
    for i, value in zip(active, solution, strict=True):
        coefficients[FEATURES[i]] = value
    return LinearTiming(**coefficients)


def profile_json(timing: LinearTiming, **notes: str) -> str:
    """The --sim-profile file of `timing`; `notes` (e.g. device, model) are kept as keys."""
    return json.dumps({"kind": "linear", **asdict(timing), **notes}, indent=2)


def _least_squares(rows: list[tuple[list[float], float]], active: list[int]) -> list[float]:
    """Solves the normal equations over the `active` features by Gaussian elimination."""
    if not active:
        return []
    n = len(active)
    if len(rows) < n:
        raise ValueError(f"{len(rows)} samples cannot fit {n} coefficients")
    a = [[sum(x[i] * x[j] for x, _ in rows) for j in active] for i in active]
    b = [sum(x[i] * y for x, y in rows) for i in active]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) < 1e-12 * max(1.0, abs(a[col][col])):
            names = ", ".join(FEATURES[i] for i in active)
            raise ValueError(f"the samples do not vary enough to fit {names}")
        a[col], a[pivot], b[col], b[pivot] = a[pivot], a[col], b[pivot], b[col]
        for r in range(n):
            if r != col:
                factor = a[r][col] / a[col][col]
                a[r] = [v - factor * p for v, p in zip(a[r], a[col], strict=True)]
                b[r] -= factor * b[col]
    return [b[i] / a[i][i] for i in range(n)]
