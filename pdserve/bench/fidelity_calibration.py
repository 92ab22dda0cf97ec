"""The calibration half of `pdserve bench fidelity`: what the served real workers spend their
time on, recorded inside them while they serve a calibration workload.

Each worker's engine executor is wrapped in `StepRecorder` and the prefill worker's KV sender
in `TransferRecorder` (through Ray's `__ray_call__`, which runs a function on the actor). A
step is thus timed where it really runs: in the worker process, pinned to its core next to
the actor's event loop, the Ray token streams and the KV receiver's threads, whose CPU time on
that core lengthens the forward on a CPU device. The steps fit a linear `--sim-profile`, the
pushes the KV link's cost per byte (`fit_transfer`).
"""

from __future__ import annotations

from typing import Any

from pdserve.bench.step_recorder import StepRecorder
from pdserve.sim.timing import StepWork


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


def _take(actor: Any) -> tuple[list[tuple[StepWork, float]], list[tuple[int, float]]]:
    recorder = actor._runtime.engine.executor
    steps, recorder.samples = recorder.samples, []
    sender = getattr(actor, "_sender", None)
    transfers: list[tuple[int, float]] = []
    if isinstance(sender, TransferRecorder):
        transfers, sender.samples = sender.samples, []
    return steps, transfers


def install_recorders(app: Any) -> None:
    """Starts recording every step and KV push of every worker of the served `app`."""
    import ray

    ray.get([w.actor.__ray_call__.remote(_install) for w in app.pool.workers.values()])


def take_samples(app: Any) -> tuple[list[tuple[StepWork, float]], list[tuple[int, float]]]:
    """(step samples of all workers, (bytes, seconds) of every KV push) recorded since the
    last call; the recorders start afresh."""
    import ray

    taken = ray.get([w.actor.__ray_call__.remote(_take) for w in app.pool.workers.values()])
    steps = [sample for worker_steps, _ in taken for sample in worker_steps]
    transfers = [sample for _, worker_transfers in taken for sample in worker_transfers]
    return steps, transfers
