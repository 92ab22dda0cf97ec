"""The calibration half of `pdserve bench fidelity`: what the served real workers spend their
time on, recorded inside them while they serve a calibration workload.

Each worker's engine executor is wrapped in `StepRecorder` and the prefill worker's KV sender
in `TransferRecorder` (through Ray's `__ray_call__`, which runs a function on the actor). A
step is thus timed where it really runs: in the worker process, pinned to its core next to
the actor's event loop, the Ray token streams and the KV receiver's threads, whose CPU time on
that core lengthens the forward on a CPU device. The steps fit a linear `--sim-profile` and,
with the gaps between them, its spread; the pushes the KV link's cost per byte
(`fit_transfer`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

from pdserve.bench.engine.step_recorder import StepRecorder
from pdserve.sim.timing import StepWork


class Samples(NamedTuple):
    """What the recorders of a system's workers saw."""

    steps: list[tuple[StepWork, float]]  # (work, seconds) of every step
    transfers: list[tuple[int, float]]  # (bytes, seconds) of every KV push
    gaps: list[float]  # one per step: seconds since the previous step if it shared a request


class TransferRecorder:
    """A KV sender that runs `inner` and keeps (bytes, seconds) of every successful push."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.samples: list[tuple[int, float]] = []

    def send(self, transfer: Any) -> Any:
        result = self.inner.send(transfer)
        self.samples.append((result.bytes, result.seconds))
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _install(actor: Any) -> None:
    engine = actor._runtime.engine
    if not isinstance(engine.executor, StepRecorder):
        engine.executor = StepRecorder(engine.executor)
    sender = getattr(actor, "_sender", None)  # only prefill workers send KV
    if sender is not None and not isinstance(sender, TransferRecorder):
        actor._sender = TransferRecorder(sender)


def _take(actor: Any) -> Samples:
    steps, gaps = actor._runtime.engine.executor.take()
    sender = getattr(actor, "_sender", None)
    transfers: list[tuple[int, float]] = []
    if isinstance(sender, TransferRecorder):
        transfers, sender.samples = sender.samples, []
    return Samples(steps, transfers, gaps)


PACING = ("sim_modelled_seconds", "sim_measured_seconds", "sim_gap_seconds", "sim_overrun_steps")


def _pacing(actor: Any) -> dict[str, float]:
    stats = actor._runtime.engine.executor.stats()
    return {key: stats.get(key, 0.0) for key in PACING}


def pacing(app: Any) -> dict[str, float]:
    """The sim executors' counters summed over the workers of `app` (zeros for torch ones):
    what their steps were modelled to take and what they took, waiting for a core included."""
    import ray

    taken = ray.get([w.actor.__ray_call__.remote(_pacing) for w in app.pool.workers.values()])
    return {key: sum(worker[key] for worker in taken) for key in PACING}


def install_recorders(app: Any) -> None:
    """Starts recording every step and KV push of every worker of the served `app`."""
    import ray

    ray.get([w.actor.__ray_call__.remote(_install) for w in app.pool.workers.values()])


def take_samples(app: Any) -> Samples:
    """The Samples of all workers recorded since the last call; the recorders start afresh."""
    import ray

    taken = ray.get([w.actor.__ray_call__.remote(_take) for w in app.pool.workers.values()])
    return Samples(*([sample for worker in taken for sample in worker[i]] for i in range(3)))
