"""RayWorkerHandle: a worker actor's Ray handle as a router.types.WorkerHandle.

The only place the router calls `.remote()`: every call becomes a coroutine, and the actor's
streaming generators async iterators (of PrefillResults, of TokenBatches). Ray itself is not imported here; the
handle's methods carry it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from pdserve.core.messages import KVReservation, PrefillResult, TokenBatch, WorkerStats, WorkRequest


class RayWorkerHandle:
    def __init__(self, actor: Any) -> None:
        self.actor = actor  # ray.actor.ActorHandle of a PrefillWorker or DecodeWorker

    async def ready(self) -> dict:
        return await self.actor.ready.remote()

    async def heartbeat(self) -> float:
        return await self.actor.heartbeat.remote()

    async def stats(self) -> WorkerStats:
        return await self.actor.stats.remote()

    async def reserve(self, work: WorkRequest) -> KVReservation | None:
        return await self.actor.reserve.remote(work)

    async def prefill(
        self, work: WorkRequest, reservation: KVReservation
    ) -> AsyncIterator[PrefillResult]:
        async for ref in self.actor.prefill.remote(work, reservation):
            yield await ref

    async def generate(self, work: WorkRequest) -> None:
        await self.actor.generate.remote(work)

    async def stream(self, request_id: str) -> AsyncIterator[TokenBatch]:
        async for ref in self.actor.stream.remote(request_id):
            yield await ref

    async def abort(self, request_id: str) -> None:
        await self.actor.abort.remote(request_id)


def ray_handles(actors: dict[str, Any]) -> dict[str, RayWorkerHandle]:
    """worker_id -> handle, for WorkerPool."""
    return {worker_id: RayWorkerHandle(actor) for worker_id, actor in actors.items()}
