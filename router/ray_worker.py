"""RayWorkerHandle: a worker actor's Ray handle as a router.types.WorkerHandle.

The only place the router calls `.remote()`: every call becomes a coroutine, and the actor's
streaming generators async iterators (of PrefillResults, of TokenBatches). Ray itself is not imported here; the
handle's methods carry it.

A caller that stops reading a stream early (its client went away) leaves the rest to be read
and dropped in the background: the actor's generator still ends, often with the error the
abort caused (the KV push it cut short), and Ray logs an error nobody retrieved as an
"Unhandled error" at ERROR, a traceback for every ordinary cancellation.
"""

from __future__ import annotations

import asyncio
import contextlib
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
        async for result in _values(self.actor.prefill.remote(work, reservation)):
            yield result

    async def generate(self, work: WorkRequest) -> None:
        await self.actor.generate.remote(work)

    async def stream(self, request_id: str) -> AsyncIterator[TokenBatch]:
        async for batch in _values(self.actor.stream.remote(request_id)):
            yield batch

    async def abort(self, request_id: str) -> None:
        await self.actor.abort.remote(request_id)

    async def reserve_pull(
        self, work: WorkRequest, pulled_blocks: int, deadline_s: float
    ) -> KVReservation | None:
        return await self.actor.reserve_pull.remote(work, pulled_blocks, deadline_s)

    async def push_prefix(
        self,
        request_id: str,
        prefix_token_ids: list[int],
        first_block: int,
        endpoint: str,
        transfer_id: str,
        deadline: float,
    ) -> int:
        return await self.actor.push_prefix.remote(
            request_id, prefix_token_ids, first_block, endpoint, transfer_id, deadline
        )

    async def fall_back(self, request_id: str) -> None:
        await self.actor.fall_back.remote(request_id)

    async def set_role(self, role: str) -> dict:
        return await self.actor.set_role.remote(role)


def ray_handles(actors: dict[str, Any]) -> dict[str, RayWorkerHandle]:
    """worker_id -> handle, for WorkerPool."""
    return {worker_id: RayWorkerHandle(actor) for worker_id, actor in actors.items()}


# How long an abandoned stream is read: an aborted request's stream ends at once; a frozen
# worker's is given up on (its refs may then still be reported unhandled).
_DRAIN_S = 60.0
_draining: set[asyncio.Task] = set()  # strong references: the loop keeps only weak ones


async def _values(refs: Any) -> AsyncIterator[Any]:
    """The values of a streaming call's refs (a Ray ObjectRefGenerator)."""
    current = None
    read_to_the_end = False
    try:
        async for current in refs:
            value = await current
            current = None
            yield value
        read_to_the_end = True
    except Exception:  # the actor's error, retrieved: nothing is left unread
        read_to_the_end = True
        raise
    finally:
        if not read_to_the_end:  # closed or cancelled early
            _drain_later(refs, current)


def _drain_later(refs: Any, current: Any) -> None:
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:  # closed by the garbage collector with no loop: nothing to read on
        return
    task = loop.create_task(_drain(refs, current))
    _draining.add(task)
    task.add_done_callback(_draining.discard)


async def stop_draining() -> None:
    """Cancels the background reads and waits for them to end, so the Ray references they
    hold are released while Ray still runs: Ray ends the process (exit status 1, no
    traceback) when one is freed after `ray.shutdown()`."""
    tasks = list(_draining)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def _drain(refs: Any, current: Any) -> None:
    """Reads (and drops) what is left of a stream, errors included."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(_DRAIN_S):
            if current is not None:
                with contextlib.suppress(Exception):
                    await current
            while True:
                try:
                    ref = await anext(refs)
                except StopAsyncIteration:
                    return
                except Exception:  # the stream's own end, failed: retrieved
                    return
                with contextlib.suppress(Exception):
                    await ref
