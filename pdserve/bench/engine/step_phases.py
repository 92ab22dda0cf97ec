"""Where a decode step's wall time goes, by the engine's phases: scheduling, the model run as
the host sees it, waiting for the GPU, sampling, turning tokens into outputs, and the rest.
On the CPU, the weight matmuls inside the model run are timed too (`models.linear_kernels.gemm`,
whichever kernel it runs): the share of a step outside them without the profiler's own cost
per op, which op_profile.py's shares include.

`bench engine --step-phases` prints it for decode steps at the largest batch. A profiler
(op_profile.py) tells which kernels or ops ran, but it also slows every op the host launches:
on an H100 it showed 29% of a compiled 8B step with no kernel running where these timers found
8% (BENCHMARKS.md, "Sixth lease"). These are plain perf_counter spans around the engine's
calls, with one synchronisation after the model run on a GPU (the sampler waits for the same
results a moment later), so a step is timed as it runs.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

PHASES = ("scheduling", "model (host)", "waiting for the GPU", "sampling", "outputs", "other")
# Timed inside a phase above ("model (host)"): not part of "other"'s difference.
WEIGHT_MATMULS = "weight matmuls"


class StepPhases:
    """Times an engine's scheduler, model runner, sampler and output step until `close()`.
    `record(step)` runs one `engine.step` and keeps its phases."""

    def __init__(self, engine: Any, device: str) -> None:
        import torch

        from pdserve.models import linear_kernels

        executor = getattr(engine.executor, "inner", engine.executor)  # under a StepRecorder
        self.steps: list[dict[str, float]] = []  # per step: seconds per phase, and "wall"
        self._current: dict[str, float] = {}
        self._restore: list[Callable[[], None]] = []
        gpu = device.startswith("cuda")

        def wait_for_gpu() -> None:
            started = time.perf_counter()
            torch.cuda.synchronize(device)
            self._add("waiting for the GPU", time.perf_counter() - started)

        # One step at a time: with the next step launched before a step's tokens are back
        # (engine/gpu_step/overlapped_steps.py) its phases would not add up to it.
        overlapping, engine.async_scheduling = engine.async_scheduling, False
        self._restore.append(lambda: setattr(engine, "async_scheduling", overlapping))
        self._wrap(engine.scheduler, "schedule", "scheduling")
        self._wrap(executor.runner, "run", "model (host)", wait_for_gpu if gpu else None)
        self._wrap(executor, "sampler", "sampling")
        self._wrap(engine.step_outputs, "postprocess", "outputs")
        if not gpu:
            self._wrap(linear_kernels, "gemm", WEIGHT_MATMULS)

    def record(self, step: Callable[[], object]) -> None:
        self._current = {}
        started = time.perf_counter()
        step()
        wall = time.perf_counter() - started
        phases = sum(v for k, v in self._current.items() if k != WEIGHT_MATMULS)
        self.steps.append({**self._current, "other": wall - phases, "wall": wall})

    def median(self, phase: str) -> float:
        """Median seconds per step of `phase` ("wall": the whole step); 0 where it never ran."""
        return statistics.median(step.get(phase, 0.0) for step in self.steps)

    def close(self) -> None:
        """Puts the wrapped calls back."""
        for restore in reversed(self._restore):
            restore()
        self._restore.clear()

    def _add(self, phase: str, seconds: float) -> None:
        self._current[phase] = self._current.get(phase, 0.0) + seconds

    def _wrap(
        self, owner: Any, name: str, phase: str, then: Callable[[], None] | None = None
    ) -> None:
        inner = getattr(owner, name)
        own = vars(owner).get(name)  # an instance attribute (the sampler), else a method

        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            result = inner(*args, **kwargs)
            self._add(phase, time.perf_counter() - started)
            if then is not None:
                then()
            return result

        def restore() -> None:
            if own is None:
                delattr(owner, name)
            else:
                setattr(owner, name, own)

        setattr(owner, name, timed)
        self._restore.append(restore)


def format_phases(phases: StepPhases) -> str:
    """A table of each phase's median milliseconds per step and its share of the median step."""
    steps = phases.steps
    wall = phases.median("wall")
    matmuls_timed = any(WEIGHT_MATMULS in s for s in steps)
    lines = [f"{'phase':<22} {'ms/step':>8} {'of step':>8}"]
    for phase in PHASES:
        if not any(phase in s for s in steps):
            continue
        seconds = phases.median(phase)
        lines.append(f"{phase:<22} {seconds * 1e3:>8.3f} {seconds / wall:>7.1%}")
        if phase == "model (host)" and matmuls_timed:
            seconds = phases.median(WEIGHT_MATMULS)
            lines.append(f"  {WEIGHT_MATMULS:<20} {seconds * 1e3:>8.3f} {seconds / wall:>7.1%}")
    lines.append(f"step {wall * 1e3:.3f} ms wall (medians of {len(steps)} decode steps)")
    if matmuls_timed:
        outside = statistics.median(1 - s.get(WEIGHT_MATMULS, 0.0) / s["wall"] for s in steps)
        lines.append(f"outside the weight matmuls: {outside:.1%} of a step (median)")
    return "\n".join(lines)


def time_decode_steps(engine: Any, device: str) -> StepPhases:
    """Steps `engine` until it has no work, each step timed by phase; the calls put back."""
    phases = StepPhases(engine, device)
    try:
        while engine.has_unfinished():
            phases.record(engine.step)
    finally:
        phases.close()
    return phases
