"""Fits a `LinearTiming` profile to measured engine steps (issue 14 point 2b: a real engine's
per-step costs become a `--sim-profile` JSON file).

Least squares of step seconds on (1, prefill tokens, decode sequences, context tokens, whether
the step computes prompt tokens), kept non-negative: a feature whose coefficient comes out
negative is dropped (its coefficient is 0) and the rest refitted, until all are non-negative
(an active-set NNLS, enough for 5 features).
`fit_spread` keeps how served steps scattered around such a fit (a `StepSpread`: each step's
measured / fitted time, the gap before it and its fitted time, in recorded order).
`fit_transfer` fits KV pushes: a fixed cost and a cost per byte.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict, replace

from pdserve.sim.timing import LinearTiming, StepSpread, StepWork

FEATURES = ("step_s", "prefill_token_s", "decode_seq_s", "context_token_s", "prefill_step_s")
# Values kept of each measured sequence (the last ones): a calibration's worth of steps of a
# small model (a few thousand) in a profile file of tens of kB.
SPREAD_LIMIT = 4096


def features(work: StepWork) -> list[float]:
    return [
        1.0,
        work.prefill_tokens,
        work.decode_seqs,
        work.context_tokens,
        1.0 if work.prefill_tokens else 0.0,
    ]


# Reweightings of the median fit: its coefficients settle to a few digits well before.
MEDIAN_FIT_ROUNDS = 30


def fit_linear(samples: Iterable[tuple[StepWork, float]], *, median: bool = False) -> LinearTiming:
    """The non-negative linear step-cost model closest (least squares) to the samples of
    (step work, measured seconds); with `median`, the one of least absolute error (each row
    reweighted by 1 / sqrt(|its residual|), MEDIAN_FIT_ROUNDS times): the typical step, which
    a few steps stalled by the host (a GPU engine's launches wait for the CPU) do not drag,
    where least squares charges their time to whatever feature they happen to share.
    ValueError when the samples cannot determine it."""
    rows = [(features(work), seconds) for work, seconds in samples]
    coefficients = _non_negative_fit(rows, FEATURES)
    for _ in range(MEDIAN_FIT_ROUNDS if median else 0):
        weighted = []
        for x, y in rows:
            residual = abs(y - sum(c * v for c, v in zip(coefficients.values(), x, strict=True)))
            w = 1 / max(residual, 1e-6 * max(abs(y), 1e-9)) ** 0.5
            weighted.append(([v * w for v in x], y * w))
        coefficients = _non_negative_fit(weighted, FEATURES)
    return LinearTiming(**coefficients)


def fit_spread(
    timing: LinearTiming,
    samples: Iterable[tuple[StepWork, float]],
    gaps: Iterable[float],
    *,
    seed: int = 0,
) -> LinearTiming:
    """`timing` with the `StepSpread` of `samples` (step work, measured seconds, in recorded
    order) around it. `gaps` holds, for each sample, the seconds from the previous step's end
    to its start when the two shared a request (else 0). Steps with and without prompt tokens
    apart, the last SPREAD_LIMIT of each, each with its fitted seconds (the sim matches steps
    of a like size); a step the fit predicts no time for is left out."""
    decode: list[tuple[float, float, float]] = []
    prefill: list[tuple[float, float, float]] = []
    for (work, seconds), gap in zip(samples, gaps, strict=True):
        fitted = timing.step_seconds(work)
        if fitted > 0:
            entry = (seconds / fitted, max(0.0, gap), fitted)
            (prefill if work.prefill_tokens else decode).append(entry)
    spread = StepSpread(decode=_kept(decode), prefill=_kept(prefill), seed=seed)
    return replace(timing, spread=spread)


def _kept(entries: list[tuple[float, ...]]) -> tuple[tuple[float, ...], ...]:
    """The last SPREAD_LIMIT entries, to 4 significant digits (a readable profile file)."""
    return tuple(tuple(float(f"{v:.4g}") for v in entry) for entry in entries[-SPREAD_LIMIT:])


def fit_transfer(samples: Iterable[tuple[int, float]]) -> tuple[float, float]:
    """(fixed seconds, seconds per byte) of KV pushes from samples of (bytes, measured
    seconds): the per-byte part is what a sim link of 1 / (seconds per byte) models; the fixed
    part (RPCs, commit) a sim push pays for real. A Theil-Sen line (the median of the slopes
    between every two samples, then the median intercept), not least squares: on a shared
    machine a few pushes stall for milliseconds whatever their size, and one such push among
    small ones would otherwise decide the slope. The slope is kept non-negative."""
    points = sorted(samples)
    if len(points) < 2:
        raise ValueError(f"{len(points)} pushes cannot fit a fixed and a per-byte cost")
    slopes = [
        (s2 - s1) / (b2 - b1)
        for i, (b1, s1) in enumerate(points)
        for b2, s2 in points[i + 1 :]
        if b2 != b1
    ]
    byte_s = max(0.0, _median(slopes)) if slopes else 0.0
    fixed_s = max(0.0, _median([s - byte_s * b for b, s in points]))
    return fixed_s, byte_s


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    if len(ordered) % 2:
        return ordered[middle]
    return (ordered[middle - 1] + ordered[middle]) / 2


def _non_negative_fit(rows: list[tuple[list[float], float]], names: tuple[str, ...]) -> dict:
    """{name: coefficient}: least squares over the features of `rows`; a feature whose
    coefficient comes out negative is dropped (0) and the rest refitted. So is prefill_step_s
    where no row has it or the others already explain it (every step with prompt tokens has
    no decode sequence and every other exactly one, say)."""
    optional = names.index("prefill_step_s") if "prefill_step_s" in names else None
    active = [i for i in range(len(names)) if i != optional or any(x[i] for x, _ in rows)]
    while True:
        try:
            solution = _least_squares(rows, active, names)
        except ValueError:
            if optional not in active:
                raise
            active.remove(optional)
            continue
        negative = [i for i, value in zip(active, solution, strict=True) if value < 0]
        if not negative:
            break
        active = [i for i in active if i not in negative]
    coefficients = dict.fromkeys(names, 0.0)
    for i, value in zip(active, solution, strict=True):
        coefficients[names[i]] = value
    return coefficients


def profile_json(timing: LinearTiming, **notes: str) -> str:
    """The --sim-profile file of `timing`; `notes` (e.g. device, model) are kept as keys. A
    timing without a spread writes no "spread" key (files as before the spread existed)."""
    data = asdict(timing)
    spread = data.pop("spread")
    text = json.dumps({"kind": "linear", **data, **notes}, indent=2)
    if spread is None:
        return text
    # One line per table, not one per number.
    tables = ",\n".join(f"    {json.dumps(k)}: {json.dumps(v)}" for k, v in spread.items())
    return text[: text.rindex("}")].rstrip() + ',\n  "spread": {\n' + tables + "\n  }\n}"


def _least_squares(
    rows: list[tuple[list[float], float]], active: list[int], names: tuple[str, ...]
) -> list[float]:
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
            fitted = ", ".join(names[i] for i in active)
            raise ValueError(f"the samples do not vary enough to fit {fitted}")
        a[col], a[pivot], b[col], b[pivot] = a[pivot], a[col], b[pivot], b[col]
        for r in range(n):
            if r != col:
                factor = a[r][col] / a[col][col]
                a[r] = [v - factor * p for v, p in zip(a[r], a[col], strict=True)]
                b[r] -= factor * b[col]
    return [b[i] / a[i][i] for i in range(n)]
