"""VirtualRoleSwitcher: `--role-switching` in the simulated cluster, on its virtual clock.

The live router's switch (router/role_switch.py) with the same parts: every `interval_s` the
plan for the traffic of the last interval goes to the same `RoleHysteresis`; a switch drains
the worker through the same `WorkerPool.drain` / `Routing.roles_changed` (no new work of its
old role), waits until the requests the router runs on it are done (at most
`drain_timeout_s`), then the worker serves the other role with the same engine and prefix
cache (`VirtualWorker.set_role`) and the pool lists it there. What plans come from is the
caller's (`plan_of`: the window's requests -> a plan as pdserve/planner/online.py answers).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pdserve.planner.cluster import VirtualCluster
from pdserve.planner.workload import ProbeRequest
from router.role_hysteresis import RoleHysteresis, pick_workers

# The requests that arrived in the last interval -> the plan for them.
PlanSource = Callable[[list[ProbeRequest]], dict[str, Any]]

_DRAIN_CHECK_S = 0.01  # how often (simulated) a drain looks at the worker's in-flight count


@dataclass(frozen=True)
class VirtualSwitch:
    """One switch in simulated seconds."""

    worker_id: str
    to_role: str
    at_s: float  # when its drain began
    drain_s: float  # until nothing of the old role ran on it (or the drain timed out)
    blocks_kept: int  # blocks in its prefix cache as it took the new role: none are dropped
    still_running: int  # requests of the old role on it when it took the new role


class VirtualRoleSwitcher:
    def __init__(
        self,
        cluster: VirtualCluster,
        hysteresis: RoleHysteresis,
        plan_of: PlanSource,
        interval_s: float,
        drain_timeout_s: float,
    ) -> None:
        self.cluster = cluster
        self.hysteresis = hysteresis
        self.plan_of = plan_of
        self.interval_s = interval_s
        self.drain_timeout_s = drain_timeout_s
        self.switches: list[VirtualSwitch] = []
        self._arrived: list[ProbeRequest] = []  # since the last plan
        self._draining = 0  # workers whose drain runs

    def start(self) -> VirtualRoleSwitcher:
        self.cluster.loop.after(self.interval_s, self._plan)
        return self

    def arrived(self, request: ProbeRequest) -> None:
        self._arrived.append(request)

    def _plan(self) -> None:
        loop = self.cluster.loop
        window, self._arrived = self._arrived, []
        if window and not self._draining:
            pool = self.cluster.pool
            prefill, decode = len(pool.of_role("prefill")), len(pool.of_role("decode"))
            target = self.hysteresis.target(self.plan_of(window), prefill, decode, loop.now)
            worker_ids = pick_workers(pool, *target) if target else []
            if worker_ids:
                self.hysteresis.switched(loop.now)
                self._draining = len(worker_ids)
                for worker_id in worker_ids:
                    pool.drain(worker_id)
                for routing in self.cluster.routers:
                    routing.roles_changed()
                for worker_id in worker_ids:
                    self._drain(worker_id, target[0])
        loop.after(self.interval_s, self._plan)

    def _drain(self, worker_id: str, to_role: str) -> None:
        cluster, started = self.cluster, self.cluster.loop.now
        pooled = cluster.pool.workers[worker_id]

        def check() -> None:
            waited = cluster.loop.now - started
            if pooled.inflight and waited < self.drain_timeout_s:
                cluster.loop.after(_DRAIN_CHECK_S, check)
                return
            worker = cluster.workers[worker_id]
            worker.set_role(to_role)
            cluster.pool.assign_role(worker_id, to_role)
            for routing in cluster.routers:  # every router side by side sees the new roles
                routing.roles_changed()
            kept = worker.engine.block_manager.num_cached_blocks
            self.switches.append(
                VirtualSwitch(worker_id, to_role, started, waited, kept, pooled.inflight)
            )
            self._draining -= 1

        check()
