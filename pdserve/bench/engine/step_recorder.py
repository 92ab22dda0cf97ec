"""Records a real engine's steps as (step work, measured seconds) samples for `fit_linear`
(issue 14 point 2b: `pdserve bench engine --profile-out FILE`).

`StepRecorder` wraps an engine's executor (the `Executor` seam of pdserve/engine/engine.py)
and times each `execute` from the step's start, the span a sim executor paces: scheduling
plus the model forward and sampling. With each step it keeps the gap from the previous step's
end to its start when the two share a request (the engine loop went straight on; else 0):
what the loop does between steps, and what else took the worker's core meanwhile.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from pdserve.sim.executor import scheduled_chunk
from pdserve.sim.fit import fit_linear, fit_spread, profile_json
from pdserve.sim.timing import StepSpread, StepWork


class StepRecorder:
    """An executor that runs `inner` and keeps one (StepWork, seconds) sample per step."""

    # A sample is one step's whole time: the engine does not launch the next step before a
    # step's tokens are back (engine/gpu_step/overlapped_steps.py) through a recorder.
    overlaps_steps = False

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.samples: list[tuple[StepWork, float]] = []
        self.gaps: list[float] = []  # one per sample: seconds since a step of the same request
        self._previous_step: tuple[float, set[str]] | None = None  # (its end, its requests)
        self._lock = threading.Lock()  # a sample and its gap are appended and taken together

    def execute(
        self, batch: Any, step_started: float
    ) -> tuple[list[int], list[int], list[float | None]]:
        chunks = [
            scheduled_chunk(seq, n) for seq, n in zip(batch.seqs, batch.num_tokens, strict=True)
        ]
        sampled = self.inner.execute(batch, step_started)
        ended = time.perf_counter()
        requests = {seq.request_id for seq in batch.seqs}
        previous, self._previous_step = self._previous_step, (ended, requests)
        busy = previous is not None and bool(requests & previous[1])
        with self._lock:
            self.samples.append((StepWork.of(chunks, len(sampled[0])), ended - step_started))
            self.gaps.append(step_started - previous[0] if busy else 0.0)
        return sampled

    def take(self) -> tuple[list[tuple[StepWork, float]], list[float]]:
        """(samples, gaps) so far, from any thread; the recorder starts afresh."""
        with self._lock:
            taken = self.samples, self.gaps
            self.samples, self.gaps = [], []
        return taken

    def __getattr__(self, name: str) -> Any:
        """Everything else (KV cache, model config, read/write_kv, stats) is the inner one's."""
        return getattr(self.inner, name)


def fastest_per_work(samples: list[tuple[StepWork, float]]) -> list[tuple[StepWork, float]]:
    """The fastest sample of every distinct step work: like the bench's best of --repeats, it
    keeps the engine's own cost and drops the time other processes took from it."""
    fastest: dict[StepWork, float] = {}
    for work, seconds in samples:
        fastest[work] = min(seconds, fastest.get(work, seconds))
    return list(fastest.items())


def write_profile(
    samples: list[tuple[StepWork, float]],
    path: str,
    *,
    every_sample: bool = False,
    median: bool = False,
    gaps: list[float] | None = None,
    **notes: str,
) -> str:
    """Fits the fastest of `samples` per step work (or, with `every_sample`, all of them: steps
    recorded in a serving worker, where what else the worker does on its core while a step runs
    is part of the step's cost), writes the --sim-profile file at `path`; returns a one-line
    summary (the coefficients and the fit's median relative error). With `every_sample` the
    profile also keeps the spread of the samples around the fit and of `gaps`, one per sample
    (fit_spread); with `median` the fit is the typical step's, least absolute error
    (fit_linear), and the spread carries the rest."""
    steps = samples if every_sample else fastest_per_work(samples)
    timing = fit_linear(steps, median=median)
    if every_sample:
        timing = fit_spread(timing, steps, gaps if gaps is not None else [0.0] * len(steps))
    Path(path).write_text(profile_json(timing, **notes) + "\n", encoding="utf-8")
    errors = sorted(abs(timing.step_seconds(w) - s) / s for w, s in steps)
    return (
        f"profile {path}: {len(samples)} steps, {len(steps)} distinct, "
        f"step {timing.step_s * 1e3:.3f} ms "
        f"+ {timing.prefill_token_s * 1e6:.2f} us/prefill token "
        f"+ {timing.decode_seq_s * 1e6:.2f} us/decode sequence "
        f"+ {timing.context_token_s * 1e9:.2f} ns/context token "
        f"+ {timing.prefill_step_s * 1e3:.3f} ms/step with prompt tokens; "
        f"median error {errors[len(errors) // 2]:.0%}{_spread_summary(timing.spread)}"
    )


def _spread_summary(spread: StepSpread | None) -> str:
    """p50/p90 of each spread table, e.g. "; p50/p90: decode steps x0.66/x1.50 of the fit,
    gaps 0.40/0.90 ms"."""
    if spread is None:
        return ""
    parts = []
    for name, table in (("decode steps", spread.decode), ("prefill steps", spread.prefill)):
        if table:
            ratios = [entry[0] for entry in table]
            parts.append(f"{name} x{_pct(ratios, 0.5):.2f}/x{_pct(ratios, 0.9):.2f} of the fit")
    gaps = [e[1] * 1e3 for table in (spread.decode, spread.prefill) for e in table if e[1]]
    if gaps:
        parts.append(f"gaps between steps {_pct(gaps, 0.5):.2f}/{_pct(gaps, 0.9):.2f} ms")
    return "; p50/p90: " + ", ".join(parts) if parts else ""


def _pct(values: list[float], fraction: float) -> float:
    return sorted(values)[int(fraction * (len(values) - 1))]
