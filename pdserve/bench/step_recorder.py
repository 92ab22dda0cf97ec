"""Records a real engine's steps as (step work, measured seconds) samples for `fit_linear`
(issue 14 point 2b: `pdserve bench engine --profile-out FILE`).

`StepRecorder` wraps an engine's executor (the `Executor` seam of pdserve/engine/engine.py)
and times each `execute` from the step's start, the span a sim executor paces: scheduling
plus the model forward and sampling.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from pdserve.sim.executor import scheduled_chunk
from pdserve.sim.fit import fit_linear, profile_json
from pdserve.sim.timing import StepWork


class StepRecorder:
    """An executor that runs `inner` and keeps one (StepWork, seconds) sample per step."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.samples: list[tuple[StepWork, float]] = []

    def execute(
        self, batch: Any, step_started: float
    ) -> tuple[list[int], list[int], list[float | None]]:
        chunks = [
            scheduled_chunk(seq, n) for seq, n in zip(batch.seqs, batch.num_tokens, strict=True)
        ]
        sampled = self.inner.execute(batch, step_started)
        seconds = time.perf_counter() - step_started
        self.samples.append((StepWork.of(chunks, len(sampled[0])), seconds))
        return sampled

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
    samples: list[tuple[StepWork, float]], path: str, *, every_sample: bool = False, **notes: str
) -> str:
    """Fits the fastest of `samples` per step work (or, with `every_sample`, all of them: steps
    recorded in a serving worker, where what else the worker does on its core while a step runs
    is part of the step's cost), writes the --sim-profile file at `path`; returns a one-line
    summary (the coefficients and the fit's median relative error)."""
    steps = samples if every_sample else fastest_per_work(samples)
    timing = fit_linear(steps)
    Path(path).write_text(profile_json(timing, **notes) + "\n", encoding="utf-8")
    errors = sorted(abs(timing.step_seconds(w) - s) / s for w, s in steps)
    return (
        f"profile {path}: {len(samples)} steps, {len(steps)} distinct, "
        f"step {timing.step_s * 1e3:.3f} ms "
        f"+ {timing.prefill_token_s * 1e6:.2f} us/prefill token "
        f"+ {timing.decode_seq_s * 1e6:.2f} us/decode sequence "
        f"+ {timing.context_token_s * 1e9:.2f} ns/context token; "
        f"median error {errors[len(errors) // 2]:.0%}"
    )
