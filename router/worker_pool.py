"""The router's view of the workers: handles, live stats, health and in-flight counts.

Each worker's stats are polled in the background by its own task (a frozen worker delays no
one else's), so routing reads the latest snapshot without a round trip. A worker whose call
fails or times out is marked unhealthy until a poll succeeds again; Ray restarts dead actors,
which come back with a new epoch. `last_seen` tells RequestFlow whether a worker that sends
nothing is busy (it still answers polls) or frozen.

With --role-switching a worker's role changes (router/role_switch.py): `drain` takes it out of
routing while it stays in its role's list, `assign_role` moves it to the other list.

A stats poll waits for the worker's current engine step, which may rightly last seconds; a
heartbeat, several a second, does not: it is answered by the actor's event loop with the age
of the engine's current step. A process that answers no heartbeat for `heartbeat_timeout_s`
is frozen or gone, and `stall_reason` says so within that time instead of the progress timeout.
Silence is counted net of the router's own stalls (router/loop_lag.py): a call that timed out
while the router's loop stalled says nothing about the worker.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from pdserve.core.messages import WorkerStats
from router.loop_lag import LoopLag
from router.ray_worker import ray_handles
from router.types import WorkerHandle

log = logging.getLogger(__name__)

StatsListener = Callable[["Worker", WorkerStats | None, WorkerStats], None]
ReadyListener = Callable[["Worker", dict | None], None]  # ready()'s answer, None: it failed


def failure_reason(exc: BaseException) -> str:
    """One line for a failed worker call: a Ray error's cause (the exception the worker raised)
    instead of the remote traceback Ray's own message carries."""
    cause = getattr(exc, "cause", None) or exc
    lines = str(cause).strip().splitlines()
    return f"{type(cause).__name__}: {lines[0]}" if lines else type(cause).__name__


@dataclass
class Worker:
    worker_id: str
    role: str  # "prefill" | "decode" | "hybrid" (both: listed in each role, see `serves`)
    handle: WorkerHandle
    healthy: bool = False
    stats: WorkerStats | None = None
    epoch: int = 0
    # Requests the router runs on this worker now (admission control); written by the pool only.
    inflight: int = 0
    last_seen: float | None = None  # time.monotonic() of the last answered poll
    lag_at_seen: float = 0.0  # the router loop's lag (LoopLag.total_s) at that time
    heartbeat_at: float | None = None  # time.monotonic() of the last answered heartbeat
    lag_at_heartbeat: float = 0.0  # the router loop's lag (LoopLag.total_s) at that time
    step_age_s: float = 0.0  # the engine's current step's age, as of that heartbeat
    poll_sent_at: float | None = None  # when the poll behind `stats` was sent (None: unknown)
    # Leaving its role (role switching): healthy, but routing sends it no new work.
    draining: bool = False

    def serves(self, role: str) -> bool:
        """Whether routing may give it work of `role` ("prefill" or "decode")."""
        return self.role in (role, "hybrid")

    @property
    def routable(self) -> bool:
        return self.healthy and not self.draining

    @property
    def actor(self) -> Any:
        """The Ray actor behind the handle (tests reach its test-only methods through it)."""
        return getattr(self.handle, "actor", None)


class WorkerPool:
    def __init__(
        self,
        prefill: dict[str, WorkerHandle],
        decode: dict[str, WorkerHandle],
        poll_interval_s: float = 0.25,
        call_timeout_s: float = 5.0,
        heartbeat_timeout_s: float = 2.0,
        hybrid: dict[str, WorkerHandle] | None = None,
    ) -> None:
        """`hybrid`: workers that serve both roles (`--hybrid`), listed in each."""
        self.workers: dict[str, Worker] = {}
        roles = (("prefill", prefill), ("decode", decode), ("hybrid", hybrid or {}))
        for role, handles in roles:
            for worker_id, handle in handles.items():
                self.workers[worker_id] = Worker(worker_id, role, handle)
        # Each role's list, made again only when a worker changes role (routing reads it at
        # every decision).
        self._list_roles()
        self._poll_interval_s = poll_interval_s
        self._call_timeout_s = call_timeout_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self._heartbeat_interval_s = min(poll_interval_s, heartbeat_timeout_s / 8)
        self._pollers: list[asyncio.Task] = []
        self.loop_lag = LoopLag()
        self.stats_listeners: list[StatsListener] = []  # (worker, previous stats, new stats)
        self.health_listeners: list[Callable[[], None]] = []  # after every poll of any worker
        self.unhealthy_listeners: list[Callable[[Worker], None]] = []  # a worker marked unhealthy
        # Requests in flight per role, the sum of its workers' `inflight` (admission control
        # reads it at every decision).
        self._inflight = {"prefill": 0, "decode": 0}
        # worker_id -> its latest failure (start, poll, engine step, request), kept after it
        # recovers: what the client and /ready are told when no worker of a pool can serve.
        self.failures: dict[str, str] = {}

    @classmethod
    def of_ray_actors(
        cls,
        prefill: dict[str, Any],
        decode: dict[str, Any],
        hybrid: dict[str, Any] | None = None,
        **settings: float,
    ) -> WorkerPool:
        """A pool of worker actors (worker_id -> Ray actor handle); `settings` as __init__'s."""
        handles = ray_handles(hybrid or {})
        return cls(ray_handles(prefill), ray_handles(decode), hybrid=handles, **settings)

    async def start(
        self, ready_timeout_s: float = 300.0, on_ready: ReadyListener | None = None
    ) -> None:
        """Waits until every worker has loaded its model or failed to (the reason kept in
        `failures`), calling `on_ready` as each one does; then polls stats in the background."""

        async def started(worker: Worker) -> None:
            try:
                info = await worker.handle.ready()
            except Exception as exc:
                self.note_failure(worker.worker_id, f"failed to start: {failure_reason(exc)}")
                info = None
            if on_ready:
                on_ready(worker, info)

        await asyncio.wait_for(
            asyncio.gather(*(started(w) for w in self.workers.values())), ready_timeout_s
        )
        await self.poll_once()
        now, lag = time.monotonic(), self.loop_lag.total_s()
        for worker in self.workers.values():
            worker.heartbeat_at, worker.lag_at_heartbeat = now, lag  # every worker just answered
        self._pollers = [asyncio.create_task(self.loop_lag.run_forever())]
        self._pollers += [asyncio.create_task(self._poll_forever(w)) for w in self.workers.values()]
        self._pollers += [
            asyncio.create_task(self._heartbeat_forever(w)) for w in self.workers.values()
        ]

    async def stop(self) -> None:
        """Ends the pollers, and waits for them: one cancelled mid-call still holds that
        call's Ray reference until it runs again."""
        for poller in self._pollers:
            poller.cancel()
        await asyncio.gather(*self._pollers, return_exceptions=True)

    def _list_roles(self) -> None:
        self._of_role = {
            role: [w for w in self.workers.values() if w.serves(role)]
            for role in ("prefill", "decode", "hybrid")
        }

    def drain(self, worker_id: str, draining: bool = True) -> None:
        """The worker takes no new work (draining) or takes it again; its role is unchanged.
        Routing must be told (Routing.roles_changed)."""
        self.workers[worker_id].draining = draining

    def assign_role(self, worker_id: str, role: str) -> None:
        """The worker serves `role` from now on, and takes work again. Routing must be told
        (Routing.roles_changed)."""
        worker = self.workers[worker_id]
        worker.role, worker.draining = role, False
        self._list_roles()

    def of_role(self, role: str, healthy_only: bool = True) -> list[Worker]:
        workers = self._of_role.get(role, [])
        return [w for w in workers if w.healthy] if healthy_only else list(workers)

    def usable(self, role: str) -> list[Worker]:
        """Healthy workers of `role` whose engine steps do not fail (readiness)."""
        return [w for w in self.of_role(role) if not (w.stats and w.stats.engine_failure)]

    def note_failure(self, worker_id: str, reason: str) -> None:
        """Remembers a worker's latest failure; it stays routable (see mark_unhealthy)."""
        self.failures[worker_id] = reason

    def why_unavailable(self, role: str, exclude: Collection[str] = ()) -> str:
        """Why no worker of `role` can take a request: each unusable (or `exclude`d) worker's
        latest failure, e.g. "no healthy decode worker (decode-0: failed to start: ...)"."""
        usable = {w.worker_id for w in self.usable(role)} - set(exclude)
        reasons = [
            f"{w.worker_id}: {self.failures[w.worker_id]}"
            for w in self._of_role.get(role, [])
            if w.worker_id not in usable and w.worker_id in self.failures
        ]
        causes = f" ({'; '.join(reasons)})" if reasons else ""
        return f"no healthy {role} worker{causes}"

    def mark_unhealthy(self, worker_id: str, reason: str) -> None:
        worker = self.workers[worker_id]
        if worker.healthy:
            log.warning("worker %s marked unhealthy: %s", worker_id, reason)
        worker.healthy = False
        self.note_failure(worker_id, reason)
        for listener in self.unhealthy_listeners:
            listener(worker)

    def inflight(self, role: str) -> int:
        """Requests in flight on the workers of `role`."""
        return self._inflight[role]

    def silent_for(self, worker_id: str) -> float:
        """Seconds of the router's running loop since the worker last answered a poll (infinite
        if it never did)."""
        worker = self.workers[worker_id]
        if worker.last_seen is None:
            return float("inf")
        return self.loop_lag.net_since(worker.last_seen, worker.lag_at_seen)

    def stall_reason(self, worker_id: str, step_timeout_s: float) -> str | None:
        """Why the worker counts as failed now, else None: its process answered no heartbeat
        for `heartbeat_timeout_s` (frozen or gone), or its engine has been in one step for
        `step_timeout_s` (stuck while the process answers)."""
        worker = self.workers[worker_id]
        if worker.heartbeat_at is None:  # the pool is not started: no heartbeats to judge by
            return None
        silent = self.loop_lag.net_since(worker.heartbeat_at, worker.lag_at_heartbeat)
        if silent >= self.heartbeat_timeout_s:
            return f"no heartbeat for {silent:.1f} s (frozen or gone)"
        step_age = worker.step_age_s + silent if worker.step_age_s else 0.0
        if step_age >= step_timeout_s:
            return f"its engine has been in one step for {step_age:.1f} s"
        return None

    @contextmanager
    def occupied(self, worker_ids: list[str]) -> Iterator[None]:
        """Counts a request as in flight on these workers while the block runs: its decode
        worker first, then its prefill worker if any."""
        # Each worker's role as the request found it: a worker may change role meanwhile. A
        # hybrid worker counts in the role it plays for this request.
        taken = [
            (worker, "decode" if i == 0 else "prefill") if worker.role == "hybrid"
            else (worker, worker.role)
            for i, worker in enumerate(self.workers[w] for w in worker_ids)
        ]  # fmt: skip
        for worker, role in taken:
            worker.inflight += 1
            self._inflight[role] += 1
        try:
            yield
        finally:
            for worker, role in taken:
                worker.inflight -= 1
                self._inflight[role] -= 1

    async def poll_once(self) -> None:
        await asyncio.gather(*(self._poll(w) for w in self.workers.values()))

    def _router_stalled(
        self, exc: Exception, sent_at: float, lag_then: float, timeout_s: float
    ) -> bool:
        """Whether `exc` is a call's timeout that the router's own stall made: the loop ran
        for less than `timeout_s` of the wait, so the worker is not judged by it."""
        return isinstance(exc, TimeoutError) and (
            self.loop_lag.net_since(sent_at, lag_then) < timeout_s
        )

    async def _poll(self, worker: Worker) -> None:
        sent_at, lag_then = time.monotonic(), self.loop_lag.total_s()
        try:
            # asyncio.timeout, not wait_for: Python 3.11's wait_for returns the call's result
            # when the call ends in the step that cancels it, and the poller, its cancel lost,
            # would outlive stop().
            async with asyncio.timeout(self._call_timeout_s):
                stats: WorkerStats = await worker.handle.stats()
        except Exception as exc:  # RayActorError, timeout: the worker is down or restarting
            if not self._router_stalled(exc, sent_at, lag_then, self._call_timeout_s):
                self.mark_unhealthy(worker.worker_id, failure_reason(exc))
        else:
            self.record_stats(worker, stats, sent_at)
        for listener in self.health_listeners:
            listener()

    def record_stats(
        self, worker: Worker, stats: WorkerStats, sent_at: float | None = None
    ) -> None:
        """A worker's answer to a stats poll sent at `sent_at` (None: unknown): the new
        snapshot, health, and the listeners."""
        if worker.epoch and stats.epoch != worker.epoch:
            log.warning(
                "worker %s restarted (epoch %d -> %d)", worker.worker_id, worker.epoch, stats.epoch
            )
        if not worker.healthy:
            log.info("worker %s is healthy", worker.worker_id)
        if stats.engine_failure:
            self.note_failure(worker.worker_id, f"engine step failed: {stats.engine_failure}")
        previous = worker.stats
        worker.stats, worker.epoch, worker.healthy = stats, stats.epoch, True
        worker.last_seen, worker.lag_at_seen = time.monotonic(), self.loop_lag.total_s()
        worker.poll_sent_at = sent_at
        for listener in self.stats_listeners:
            listener(worker, previous, stats)

    async def _heartbeat_forever(self, worker: Worker) -> None:
        while True:
            await asyncio.sleep(self._heartbeat_interval_s)
            sent_at, lag_then = time.monotonic(), self.loop_lag.total_s()
            try:
                async with asyncio.timeout(self.heartbeat_timeout_s):  # not wait_for: see _poll
                    step_age = await worker.handle.heartbeat()
            except Exception as exc:  # RayActorError, timeout: frozen, dead or restarting
                if not self._router_stalled(exc, sent_at, lag_then, self.heartbeat_timeout_s):
                    reason = f"heartbeat: {type(exc).__name__}: {exc}"
                    self.mark_unhealthy(worker.worker_id, reason)
            else:
                worker.heartbeat_at, worker.step_age_s = time.monotonic(), step_age
                worker.lag_at_heartbeat = self.loop_lag.total_s()

    async def _poll_forever(self, worker: Worker) -> None:
        while True:
            await asyncio.sleep(self._poll_interval_s)
            await self._poll(worker)
