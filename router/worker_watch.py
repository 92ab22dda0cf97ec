"""Calls to a worker that fail when it stalls, for RequestFlow (router/request_flow.py): a call's
failure, or no answer while the worker sends nothing, raises WorkerFailed naming the worker, so
the request is retried elsewhere. Stalled: no heartbeat for the pool's heartbeat timeout (a
frozen process, failed over in seconds), or an engine step, or no answer to stats polls, as
long as `progress_timeout_s` (0 = never): it may be frozen, not dead."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable
from contextlib import aclosing
from typing import TypeVar

from pdserve.core.messages import TokenBatch
from router.worker_pool import WorkerPool, failure_reason

T = TypeVar("T")

# How often a call waiting on a worker checks that the worker has not stalled.
_WATCH_INTERVAL_S = 0.1


class WorkerFailed(RuntimeError):
    def __init__(self, worker_id: str, message: str) -> None:
        super().__init__(f"{worker_id}: {message}")
        self.worker_id = worker_id
        self.reason = message


class WorkerWatch:
    def __init__(self, pool: WorkerPool, progress_timeout_s: float) -> None:
        self._pool = pool
        self._progress_timeout_s = progress_timeout_s

    async def guarded(self, worker_id: str, call: Awaitable[T], also_watch: str | None = None) -> T:
        """Awaits a worker's call; any failure, or no answer while the worker (or `also_watch`,
        a worker the call depends on) stalls, becomes WorkerFailed naming the stalled worker
        (the end of a stream, StopAsyncIteration, passes through). Stalled: no heartbeat for
        the pool's heartbeat timeout (a frozen process, failed over in seconds), or an engine
        step, or no answer to stats polls, as long as the progress timeout."""
        task = asyncio.ensure_future(call)
        timeout = self._progress_timeout_s
        started = time.monotonic()
        try:
            while not task.done():
                await asyncio.wait({task}, timeout=_WATCH_INTERVAL_S if timeout > 0 else None)
                if task.done():
                    continue
                waited = time.monotonic() - started
                for watched in filter(None, (worker_id, also_watch)):
                    reason = self._stall_reason(watched, waited)
                    if reason:
                        self._pool.mark_unhealthy(watched, reason)
                        raise WorkerFailed(watched, reason)
        finally:
            if not task.done():
                task.cancel()
                await asyncio.wait({task})  # a stream's generator is idle again once it returns
        try:
            return task.result()
        except StopAsyncIteration:
            raise
        except Exception as exc:
            raise WorkerFailed(worker_id, failure_reason(exc)) from exc

    def _stall_reason(self, worker_id: str, waited: float) -> str | None:
        """Why a worker that sent nothing for `waited` seconds counts as failed, else None."""
        timeout = self._progress_timeout_s
        reason = self._pool.stall_reason(worker_id, timeout)
        if not reason and waited >= timeout and self._pool.silent_for(worker_id) >= timeout:
            reason = f"no progress and no answer to stats polls for {waited:.1f} s"
        return reason

    async def guarded_stream(
        self, worker_id: str, stream: AsyncIterator[TokenBatch]
    ) -> AsyncIterator[TokenBatch]:
        """The worker's batches, each awaited as in `guarded`; a batch that ends the stream
        with "abort" means the worker dropped the request: a failure too."""
        async with aclosing(stream):
            while True:
                try:
                    batch = await self.guarded(worker_id, anext(stream))
                except StopAsyncIteration:
                    return
                if batch.finished and batch.finish_reason == "abort":
                    reason = "stream ended by the worker (aborted or expired)"
                    if batch.error:
                        reason = f"engine step failed: {batch.error}"
                    raise WorkerFailed(worker_id, reason)
                yield batch
