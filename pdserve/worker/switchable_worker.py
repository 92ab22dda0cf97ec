"""SwitchableWorker: a worker that serves either role on one engine (`--role-switching`).

Every worker of a role-switching deployment is one of these: it has the prefill actor's
sender and the decode actor's receiver, so it answers prefill() as well as reserve(),
generate() and stream(). Its role is what the router routes to it (router/role_switch.py):
the router stops sending work of the old role, waits for what runs to finish, then calls
set_role(). The engine, its prefix cache and the index entries it published stay as they are:
no process restart, no cache lost. Work of the old role still running when set_role() is
called (a drain that hit its deadline) simply finishes on the same engine.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from decode_service.worker import DecodeWorker
from pdserve.worker.worker_spec import WorkerSpec
from prefill_service.worker import PrefillWorker

if TYPE_CHECKING:
    from pdserve.worker.worker_runtime import WorkerRuntime

log = logging.getLogger(__name__)

ROLES = ("prefill", "decode")
# A hybrid worker (--hybrid) serves both roles at once, for good: the router lists it in both.
START_ROLES = (*ROLES, "hybrid")


class SwitchableWorker(PrefillWorker, DecodeWorker):
    def __init__(self, worker_id: str, spec: WorkerSpec, role: str) -> None:
        if role not in START_ROLES:
            raise ValueError(f"role must be one of {', '.join(START_ROLES)}, got {role!r}")
        super().__init__(worker_id, spec)
        self.role = role  # shadows the class attribute: this worker's current role

    def _start_transport(self, runtime: WorkerRuntime) -> None:
        PrefillWorker._start_transport(self, runtime)
        DecodeWorker._start_transport(self, runtime)

    async def abort(self, request_id: str) -> None:
        # The decode side's abort also fences a prefill() (one AbortedRequests serves both).
        await DecodeWorker.abort(self, request_id)

    async def set_role(self, role: str) -> dict:
        """Serves `role` from now on (the name in its stats, logs and traces' attributes);
        returns what it kept: the blocks of its prefix cache and the requests still running."""
        if role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
        runtime = await self._started()
        started = time.perf_counter()
        previous, self.role = self.role, role
        runtime.set_role(role)
        engine_stats = await runtime.loop.acall(runtime.engine.stats)
        kept = {
            "worker_id": self.worker_id,
            "from_role": previous,
            "to_role": role,
            "blocks_kept": int(engine_stats["num_cached_blocks"]),
            "running": int(engine_stats["num_running"]) + int(engine_stats["num_waiting"]),
            "seconds": time.perf_counter() - started,
        }
        log.info(
            "worker %s switched role %s -> %s, keeping %d cached blocks (%d requests running)",
            self.worker_id,
            previous,
            role,
            kept["blocks_kept"],
            kept["running"],
        )
        return kept
