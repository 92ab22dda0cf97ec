"""Looks inside a served system from the process that runs it: process ids and leftovers.

The soak benchmark samples the processes' memory with it, and the fuzz and chaos suites check
with it that no KV block, reservation or transfer outlives its request. Worker facts come from
the actors themselves (a Ray call per worker), the Redis pid from the app's private server
(it changes when its supervisor restarts it).
No torch here; Ray is imported only when called.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class WorkerLeftovers:
    """What a worker still holds for requests; all zero once every request has ended."""

    used_blocks: int
    reserved: int
    held: int
    waiting: int
    running: int
    open_transfers: int  # KV transfers its receiver still waits for (decode workers)

    @property
    def clean(self) -> bool:
        return not any(
            (
                self.used_blocks,
                self.reserved,
                self.held,
                self.waiting,
                self.running,
                self.open_transfers,
            )
        )


def _pid_of_actor(actor: Any) -> int:
    return os.getpid()


def _open_transfers_of_actor(actor: Any) -> int:
    receiver = getattr(actor, "_receiver", None)  # only decode workers receive KV
    return len(receiver.open_transfer_ids()) if receiver is not None else 0


def worker_pids(app: Any, timeout_s: float = 10.0) -> dict[str, int]:
    """{worker_id: pid} of each worker actor's current process (it changes on a restart);
    a worker that does not answer within `timeout_s` (restarting, frozen) is left out."""
    import ray

    deadline = time.monotonic() + timeout_s
    refs = {wid: w.actor.__ray_call__.remote(_pid_of_actor) for wid, w in app.pool.workers.items()}
    pids = {}
    for worker_id, ref in refs.items():
        try:
            pids[worker_id] = ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
        except (ray.exceptions.RayError, TimeoutError):
            continue
    return pids


def redis_pid(app: Any) -> int | None:
    """The pid of the app's private redis-server; None when it uses an external Redis."""
    server = getattr(app, "redis_server", None)
    return server.pid if server is not None else None


def leftovers(app: Any, timeout_s: float = 10.0) -> dict[str, WorkerLeftovers]:
    """Every worker's leftovers now."""
    import ray

    workers = list(app.pool.workers.values())
    stats = ray.get([w.actor.stats.remote() for w in workers], timeout=timeout_s)
    transfers = ray.get(
        [w.actor.__ray_call__.remote(_open_transfers_of_actor) for w in workers],
        timeout=timeout_s,
    )
    return {
        w.worker_id: WorkerLeftovers(
            used_blocks=s.num_used_blocks,
            reserved=s.num_reserved,
            held=s.num_held,
            waiting=s.num_waiting,
            running=s.num_running,
            open_transfers=n,
        )
        for w, s, n in zip(workers, stats, transfers, strict=True)
    }


def settled_leftovers(app: Any, timeout_s: float = 20.0) -> dict[str, WorkerLeftovers]:
    """Waits until every worker is clean (aborts and reservation deadlines take effect
    asynchronously); returns the last leftovers seen, clean or not after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            found = leftovers(app)
        except Exception:  # a worker that is restarting does not answer yet
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
            continue
        if all(w.clean for w in found.values()) or time.monotonic() > deadline:
            return found
        time.sleep(0.2)
