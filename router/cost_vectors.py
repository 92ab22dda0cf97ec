"""The cost model's lines (router/cost_model.py) over numpy vectors, one element per worker, for
the option matrix (router/option_matrix.py): the same IEEE operations, in the same order, as
the scalar methods they mirror, so the matrix's objectives equal the enumeration's bit for bit."""

from __future__ import annotations

import numpy as np

from router.cost_model import CostModel, LinearFit


def line(fit: LinearFit, x: np.ndarray) -> np.ndarray:
    """LinearFit.predict over a vector."""
    a, b = fit.coefficients
    return a + b * np.maximum(0.0, x)


def prefill_seconds(cost: CostModel, tokens: np.ndarray, *, local: bool) -> np.ndarray:
    """CostModel.prefill_seconds over a vector: the slowest of its lines."""
    seconds = None
    for fit in cost.prefill_fits(local):
        values = line(fit, tokens)
        seconds = values if seconds is None else np.maximum(seconds, values)
    return seconds


def stall_seconds(cost: CostModel, tokens: np.ndarray) -> np.ndarray:
    """CostModel.stall_seconds over a vector: the fastest of its lines."""
    seconds = None
    for fit in cost.prefill_fits(True):
        values = line(fit, tokens)
        seconds = values if seconds is None else np.minimum(seconds, values)
    return seconds


def queue_seconds(
    cost: CostModel, tokens: np.ndarray, requests: np.ndarray, *, local: bool
) -> np.ndarray:
    """CostModel.prefill_queue_seconds over vectors: the measured drain, else the slowest of
    its lines."""
    drain = None if local else cost.drain_seconds_per_token()
    if drain is not None:
        return tokens * drain
    steps = np.minimum(requests, tokens // max(1, cost.step_tokens))
    waits = None
    for fit in cost.prefill_fits(local):
        a, b = fit.coefficients
        wait = a * steps + b * tokens
        waits = wait if waits is None else np.maximum(waits, wait)
    return waits
