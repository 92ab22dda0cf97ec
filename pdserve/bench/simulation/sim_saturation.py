"""Refusing the figures of a sim run when the CPU rather than the timing model set the pace
(issue 14 point 4).

`SaturationCheck` reads every sim worker's counters before
and after a run; `verdict()` lists what was saturated:
  - a worker whose steps took longer than modelled (measured / modelled - 1 > max_excess):
    the step's Python work, or a late wake-up on a busy CPU, stretched simulated time;
  - a worker with steps whose Python work alone outlasted the scaled model (overrun steps),
    more than `max_overrun_fraction` of its decode steps (a rare late step is a busy
    neighbour on a shared machine, and the excess above already counts the time it lost);
  - this process (router, Redis client and load generator share its GIL) busy for more than
    `max_router_busy` of one core: token delivery, not the model, then paces the streams;
  - requests that failed other than by admission control (RESOURCE_EXHAUSTED): sim workers
    never fail on their own, so such a failure is a worker that missed its stats polls or
    progress deadline on a starved CPU (`note_failures`).
`check` raises `Saturated` with one line naming them and a `--sim-time-scale` to try.
"""

from __future__ import annotations

import argparse
import math
import resource
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pdserve.bench.simulation.sim_run import sim_workers, wait_idle
from pdserve.workloads.metrics import RequestRecord


class Saturated(Exception):
    """The figures of a run describe the CPU, not the model: the bench must not report them."""


def saturation_check(app, args: argparse.Namespace) -> SaturationCheck:
    """The SaturationCheck of the shared flags."""
    return SaturationCheck(
        app,
        args.sim_time_scale,
        max_excess=args.max_excess,
        max_overrun_fraction=args.max_overrun_fraction,
    )


def checked_run(
    app,
    args: argparse.Namespace,
    run_once: Callable[[int], list[RequestRecord]],
    label: str,
) -> tuple[list[RequestRecord], SaturationCheck]:
    """`run_once(attempt)` (it sends the load; its records are returned) under a saturation
    check that also waits for the workers to go idle. A saturated attempt is discarded and run
    again with the next attempt number (for fresh prompts: a burst from a neighbour on a shared
    machine passes), at most `args.retries` times; then Saturated names `label`."""
    line = ""
    for attempt in range(args.retries + 1):
        with saturation_check(app, args) as check:
            records = run_once(attempt)
            wait_idle(app)
        check.note_failures(records)
        line = check.verdict()
        if line is None:
            return records, check
        print(f"  {label}: attempt {attempt + 1} discarded: {line}", flush=True)
    raise Saturated(f"{label}: {line}")


@dataclass
class WorkerPace:
    """One sim worker's counters over a run, in simulated seconds."""

    worker_id: str
    modelled_s: float
    measured_s: float
    overrun_steps: int
    decode_steps: int = 0

    @property
    def excess(self) -> float:
        """How much longer its steps took than modelled (0.1 = 10 % longer)."""
        return self.measured_s / self.modelled_s - 1 if self.modelled_s > 0 else 0.0


class SaturationCheck:
    """`with SaturationCheck(app, time_scale) as check: ...run...`; then `check.verdict()`."""

    def __init__(
        self,
        app,
        time_scale: float,
        max_excess: float = 0.05,
        max_router_busy: float = 0.8,
        max_overrun_fraction: float = 0.01,
    ) -> None:
        self.app = app
        self.time_scale = time_scale
        self.max_excess = max_excess
        self.max_overrun_fraction = max_overrun_fraction
        self.max_router_busy = max_router_busy
        self.workers: list[WorkerPace] = []
        self.router_busy = 0.0  # this process's CPU seconds per wall second over the run
        self.failures: dict[str, int] = {}  # status -> requests, admission control excluded

    def __enter__(self) -> SaturationCheck:
        self._before = sim_workers(self.app)
        self._cpu, self._wall = _process_cpu_seconds(), time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        wall = time.perf_counter() - self._wall
        self.router_busy = (_process_cpu_seconds() - self._cpu) / wall if wall > 0 else 0.0
        after = sim_workers(self.app)
        self.workers = [
            WorkerPace(
                worker_id,
                s.sim_modelled_seconds - self._before[worker_id].sim_modelled_seconds,
                s.sim_measured_seconds - self._before[worker_id].sim_measured_seconds,
                s.sim_overrun_steps - self._before[worker_id].sim_overrun_steps,
                s.decode_steps - self._before[worker_id].decode_steps,
            )
            for worker_id, s in sorted(after.items())
            if worker_id in self._before
        ]

    def note_failures(self, records: Sequence[RequestRecord]) -> None:
        """Counts the run's failed requests that admission control does not explain."""
        for r in records:
            if not r.ok and r.error_code != "RESOURCE_EXHAUSTED":
                code = r.error_code or "UNKNOWN"
                self.failures[code] = self.failures.get(code, 0) + 1

    def problems(self) -> list[str]:
        """What was saturated, one phrase each; empty when the run's figures stand."""
        found = [
            f"{w.worker_id} steps {w.excess:+.0%} over modelled"
            + (f", {w.overrun_steps} overrun steps" if w.overrun_steps else "")
            for w in self.workers
            if w.excess > self.max_excess or self._overran(w)
        ]
        if self.router_busy > self.max_router_busy:
            found.append(f"router process {self.router_busy:.0%} of a core busy")
        if self.failures:
            failed = ", ".join(f"{n} {code}" for code, n in sorted(self.failures.items()))
            found.append(f"requests failed ({failed})")
        return found

    def _overran(self, w: WorkerPace) -> bool:
        return w.overrun_steps > self.max_overrun_fraction * w.decode_steps

    def suggested_scale(self) -> float:
        """A time scale that should leave the CPU room: the current one stretched by the worst
        excess (at least doubled), rounded up to a round number."""
        worst = max([w.excess for w in self.workers] + [0.0])
        busy = self.router_busy / self.max_router_busy if self.max_router_busy else 1.0
        factor = max(2.0, 1.0 + worst, busy * 1.5)
        return _round_up(self.time_scale * factor)

    def verdict(self) -> str | None:
        """None when the figures stand, else the one-line refusal."""
        found = self.problems()
        if not found:
            return None
        return (
            f"refusing to report: saturated at --sim-time-scale {self.time_scale:g} "
            f"({'; '.join(found)}); try --sim-time-scale {self.suggested_scale():g}"
        )

    def check(self) -> None:
        """Raises Saturated with the verdict's line if the run was saturated."""
        line = self.verdict()
        if line:
            raise Saturated(line)

    def summary(self) -> dict:
        return {
            "time_scale": self.time_scale,
            "router_busy": self.router_busy,
            "max_excess": max([w.excess for w in self.workers] + [0.0]),
            "overrun_steps": sum(w.overrun_steps for w in self.workers),
            "modelled_s": sum(w.modelled_s for w in self.workers),
        }


def _process_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _round_up(value: float) -> float:
    """The next of 1, 2, 5 x 10^k at or above `value`."""
    exponent = math.floor(math.log10(value))
    for step in (1, 2, 5, 10):
        candidate = step * 10.0**exponent
        if candidate >= value * (1 - 1e-9):
            return candidate
    return 10.0 ** (exponent + 1)
