"""WorkerActor: the part of the prefill and decode actors that is the same for both roles.

Ray runs an actor's __init__ outside its event loop, but the engine loop needs that loop, so
a worker starts lazily on its first call (ready() or any other); a restarted actor therefore
comes back by itself on the router's next call. Importable without torch: the runtime is
imported only when the worker starts, inside the actor process.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from pdserve.core.messages import WorkerStats
from pdserve.heap import freeze_startup_heap
from pdserve.worker.worker_spec import WorkerSpec

if TYPE_CHECKING:
    from pdserve.worker.worker_runtime import WorkerRuntime


class WorkerActor:
    role = ""  # "prefill" | "decode", set by the subclass

    def __init__(self, worker_id: str, spec: WorkerSpec) -> None:
        self.worker_id = worker_id
        self._spec = spec
        self._kv_config = spec.kv
        self._runtime: WorkerRuntime | None = None
        self._start_lock = asyncio.Lock()

    async def _started(self) -> WorkerRuntime:
        async with self._start_lock:
            if self._runtime is None:
                from pdserve.worker.worker_runtime import WorkerRuntime

                self._runtime = WorkerRuntime(self.worker_id, self.role, self._spec)
                self._start_transport(self._runtime)
                if self._spec.freeze_startup_heap:
                    freeze_startup_heap(self.worker_id)
        return self._runtime

    def _start_transport(self, runtime: WorkerRuntime) -> None:
        """Creates the role's KV sender or receiver once the engine exists."""
        raise NotImplementedError

    def _ready_info(self) -> dict:
        """Role-specific fields of ready()'s answer."""
        return {}

    async def ready(self) -> dict:
        """Starts the worker (model load) if needed and says who it is."""
        runtime = await self._started()
        return {
            "worker_id": self.worker_id,
            "epoch": runtime.epoch,
            "metrics_port": runtime.metrics_port,
            **self._ready_info(),
        }

    async def heartbeat(self) -> float:
        """Answered by the actor's event loop without waiting for the engine: that the process
        runs, and how long its engine has been in the current step (0 = idle or not started).
        The router fails over from a worker whose heartbeat stops (docs/design.md)."""
        return 0.0 if self._runtime is None else self._runtime.loop.step_age()

    async def stats(self) -> WorkerStats:
        runtime = await self._started()
        return await runtime.stats()
