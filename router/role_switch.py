"""RoleSwitcher (`pdserve serve --role-switching`): moves workers between prefill and decode,
without a restart, when the online planner's split is worth it (router/role_hysteresis.py).

Every worker of such a deployment can serve both roles on one engine
(pdserve/worker/switchable_worker.py); its role is what the router routes to it. A switch of
one or more workers (the plan's whole move, drained together):
  1. drain: the pool marks each worker draining and routing rebuilds its rows, so no new work
     of the old role reaches it;
  2. wait until the requests the router runs on it finish (a decode worker's sequences run to
     their end, a prefill worker's queue and pushes complete), at most `drain_timeout_s`:
     what still runs then finishes on the same engine beside the new role's work;
  3. set_role on the worker, then the pool lists it under its new role and routing rebuilds.
Its prefix cache and its prefix-index entries (by worker id) stay valid throughout: the first
request of the new role that shares a prefix finds it there.

Each switch is logged and exported: pdserve_role_switches_total{worker,to_role},
pdserve_role_switch_seconds (drain and set_role), pdserve_role_switch_blocks_kept{worker}.
`switch()` is also the admin call (tests and drills call it directly); one runs at a time.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pdserve import metrics
from router.role_hysteresis import RoleHysteresis, pick_workers
from router.worker_pool import Worker, WorkerPool

log = logging.getLogger(__name__)

_DRAIN_CHECK_S = 0.02  # how often a drain looks at the worker's in-flight count


@dataclass(frozen=True)
class RoleSwitch:
    """One switch as it happened."""

    worker_id: str
    from_role: str
    to_role: str
    drain_s: float  # from the drain's start until no request of the old role ran, or timeout
    seconds: float  # the whole switch, set_role included
    blocks_kept: int  # blocks of the worker's prefix cache at the switch: none were dropped
    still_running: int  # requests of the old role still running when it took the new one


class RoleSwitcher:
    def __init__(
        self,
        pool: WorkerPool,
        roles_changed: Callable[[], None],  # Routing.roles_changed
        hysteresis: RoleHysteresis,
        drain_timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.pool = pool
        self.roles_changed = roles_changed
        self.hysteresis = hysteresis
        self.drain_timeout_s = drain_timeout_s
        self.clock = clock
        self.switches: list[RoleSwitch] = []
        self._lock = asyncio.Lock()
        self._tasks: set[asyncio.Task] = set()
        pool.stats_listeners.append(self._restore_role)

    def _restore_role(self, worker: Worker, previous: Any, stats: Any) -> None:
        """A restarted actor comes back in the role it was created with: it is told the one
        the router routes to it (its stats' role decides how the cost model reads them)."""
        restarted = previous is None or previous.epoch != stats.epoch
        if stats.role == worker.role or worker.draining or not restarted:
            return  # (a switch under way tells it itself)
        log.warning("worker %s came back as %s; it serves %s", worker.worker_id, stats.role,
                    worker.role)  # fmt: skip
        self._spawn(worker.handle.set_role(worker.role))

    def _spawn(self, coroutine) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def on_plan(self, plan: dict[str, Any]) -> None:
        """An online plan (router/online_plan.py's listener): starts a switch when the
        hysteresis says so and none is running."""
        if self._lock.locked():
            return
        prefill = len(self.pool.of_role("prefill"))
        decode = len(self.pool.of_role("decode"))
        target = self.hysteresis.target(plan, prefill, decode, self.clock())
        if target is None:
            log.info(
                "role switching: staying at %dP:%dD (%s)",
                prefill,
                decode,
                self.hysteresis.held_because,
            )
            return
        to_role, count = target
        worker_ids = pick_workers(self.pool, to_role, count)
        if not worker_ids:
            return
        self.hysteresis.switched(self.clock())
        self._spawn(self._switch_logged(worker_ids, to_role))

    async def _switch_logged(self, worker_ids: list[str], to_role: str) -> None:
        try:
            await self.switch(to_role, *worker_ids)
        except Exception:  # a failed switch leaves its workers in their old role, serving
            log.exception("role switch of %s to %s failed", ", ".join(worker_ids), to_role)

    async def switch(self, to_role: str, *worker_ids: str) -> list[RoleSwitch]:
        """Drains the workers of their role, together, and has each serve `to_role` once its
        drain is done (ValueError: one serves it already, or no decode worker would be left)."""
        async with self._lock:
            for worker_id in worker_ids:
                if self.pool.workers[worker_id].role == to_role:
                    raise ValueError(f"{worker_id} serves {to_role} already")
            decode = {w.worker_id for w in self.pool.of_role("decode")}
            if to_role == "prefill" and not decode - set(worker_ids):
                raise ValueError("no decode worker would be left")
            started = time.perf_counter()
            for worker_id in worker_ids:
                self.pool.drain(worker_id)
            self.roles_changed()
            switches = await asyncio.gather(
                *(self._switch_one(w, to_role, started) for w in worker_ids)
            )
        return list(switches)

    async def _switch_one(self, worker_id: str, to_role: str, started: float) -> RoleSwitch:
        worker = self.pool.workers[worker_id]
        from_role = worker.role
        try:
            deadline = started + self.drain_timeout_s
            while worker.inflight and time.perf_counter() < deadline:
                await asyncio.sleep(_DRAIN_CHECK_S)
            drain_s = time.perf_counter() - started
            kept = await worker.handle.set_role(to_role)
        except BaseException:
            self.pool.drain(worker_id, False)  # back to serving its old role
            self.roles_changed()
            raise
        self.pool.assign_role(worker_id, to_role)
        self.roles_changed()
        switch = RoleSwitch(
            worker_id,
            from_role,
            to_role,
            drain_s,
            time.perf_counter() - started,
            kept["blocks_kept"],
            worker.inflight,
        )
        self.switches.append(switch)
        metrics.observe_role_switch(switch)
        log.warning(
            "role switch: %s %s -> %s in %.2f s (drain %.2f s), %d cached blocks kept, "
            "%d requests of the old role still running",
            worker_id,
            from_role,
            to_role,
            switch.seconds,
            switch.drain_s,
            switch.blocks_kept,
            switch.still_running,
        )
        return switch

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
