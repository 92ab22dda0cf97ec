"""The router's view of the worker actors: handles, live stats, health and in-flight counts.

Stats are polled in the background (one Ray call per worker per interval), so routing reads
the latest snapshot without a round trip. A worker whose call fails is marked unhealthy until a
poll succeeds again; Ray restarts dead actors, which come back with a new epoch.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

from pdserve.core.messages import WorkerStats

log = logging.getLogger(__name__)


@dataclass
class Worker:
    worker_id: str
    role: str  # "prefill" | "decode"
    actor: Any  # ray.actor.ActorHandle
    healthy: bool = False
    stats: WorkerStats | None = None
    inflight: int = 0  # requests the router has on this worker now (admission control)
    # Routed here since the last stats poll: load the snapshot cannot show yet.
    routed_since_poll: int = 0
    routed_tokens_since_poll: int = 0
    epoch: int = 0


class WorkerPool:
    def __init__(
        self,
        prefill: dict[str, Any],
        decode: dict[str, Any],
        poll_interval_s: float = 0.25,
        call_timeout_s: float = 5.0,
    ) -> None:
        self.workers: dict[str, Worker] = {}
        for role, actors in (("prefill", prefill), ("decode", decode)):
            for worker_id, actor in actors.items():
                self.workers[worker_id] = Worker(worker_id, role, actor)
        self._poll_interval_s = poll_interval_s
        self._call_timeout_s = call_timeout_s
        self._poller: asyncio.Task | None = None
        self.stats_listeners: list = []  # called with (worker, previous stats, new stats)
        self.round_listeners: list = []  # called after every poll of all workers

    async def start(self, ready_timeout_s: float = 300.0) -> None:
        """Waits until every worker has loaded its model, then polls stats in the background."""
        await asyncio.wait_for(
            asyncio.gather(*(w.actor.ready.remote() for w in self.workers.values())),
            ready_timeout_s,
        )
        await self.poll_once()
        self._poller = asyncio.create_task(self._poll_forever())

    async def stop(self) -> None:
        if self._poller:
            self._poller.cancel()

    def of_role(self, role: str, healthy_only: bool = True) -> list[Worker]:
        return [
            w for w in self.workers.values() if w.role == role and (w.healthy or not healthy_only)
        ]

    def mark_unhealthy(self, worker_id: str, reason: str) -> None:
        worker = self.workers[worker_id]
        if worker.healthy:
            log.warning("worker %s marked unhealthy: %s", worker_id, reason)
        worker.healthy = False

    async def poll_once(self) -> None:
        await asyncio.gather(*(self._poll(w) for w in self.workers.values()))
        for listener in self.round_listeners:
            listener()

    async def _poll(self, worker: Worker) -> None:
        try:
            stats: WorkerStats = await asyncio.wait_for(
                worker.actor.stats.remote(), self._call_timeout_s
            )
        except Exception as exc:  # RayActorError, timeout: the worker is down or restarting
            self.mark_unhealthy(worker.worker_id, f"{type(exc).__name__}: {exc}")
            return
        if worker.epoch and stats.epoch != worker.epoch:
            log.warning(
                "worker %s restarted (epoch %d -> %d)", worker.worker_id, worker.epoch, stats.epoch
            )
        if not worker.healthy:
            log.info("worker %s is healthy", worker.worker_id)
        previous = worker.stats
        worker.stats, worker.epoch, worker.healthy = stats, stats.epoch, True
        worker.routed_since_poll = worker.routed_tokens_since_poll = 0
        for listener in self.stats_listeners:
            listener(worker, previous, stats)

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(self._poll_interval_s)
            await self.poll_once()
