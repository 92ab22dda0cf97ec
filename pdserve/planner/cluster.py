"""VirtualCluster: P prefill and D decode simulated workers behind the router's own routing
(`router.routing.Routing` with its `RoutingPolicy` and online `CostModel`), on one virtual clock.

The router's `WorkerPool` holds the workers' snapshots, filled every poll interval from each
worker's `stats()` as the real pool's polls fill it (answered between engine steps), so the
policy sees the same lagging snapshots plus its own in-flight counts. No prefix index (Redis)
takes part unless `index_lag_s` is given: then the router's copy of the index is a
VirtualIndex fed by the workers' KV events `index_lag_s` after each step; without it the
router knows cached prefixes only from what it routed itself. P = 0 is colocated serving:
every request is prefilled on its decode worker; unless `hybrid`: then the D workers each
serve both roles (`--hybrid`), and the router may prefill a request on any other of them.

`router_replicas` > 1 runs that many routers side by side, as a service runs several for
availability behind a load balancer that spreads requests over them (request k goes to
replica k mod R): each has its own policy, cost model, in-flight counts and memory of its own
routes (recent prefixes; the `approximate` policy's whole cache view), and all read the same
workers' polls and the same index.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from pdserve.config import RouterConfig
from pdserve.engine.engine import RequestOutput
from pdserve.planner.deployment import Deployment
from pdserve.planner.events import EventLoop
from pdserve.planner.virtual_index import VirtualIndex
from pdserve.planner.virtual_worker import VirtualWorker
from router.cost_model import CostModel
from router.policy import RoutingPolicy
from router.recent_prefixes import RecentPrefixes
from router.routing import Routing
from router.worker_pool import WorkerPool

# (worker, one of a request's outputs) -> None
Listener = Callable[[VirtualWorker, RequestOutput], None]


@dataclass(frozen=True)
class RouterTiming:
    """The router's pace in simulated seconds (a live sim cluster at time scale S runs these
    wall-clock intervals, i.e. these divided by S in simulated time)."""

    poll_interval_s: float = 0.25  # WorkerPool's stats polls
    room_wait_s: float = 2.0  # RequestFlow's patience for room
    room_backoff_s: tuple[float, ...] = (0.02, 0.05, 0.1, 0.2)  # its pauses between tries
    # The cost model's prior lines (seconds) as a multiple of CostModel's: a live router at
    # time scale S starts from the same priors in wall seconds, i.e. 1 / S of them in
    # simulated time, and until its samples outweigh them they decide its first routes.
    cost_prior_scale: float = 1.0

    def scaled(self, factor: float) -> RouterTiming:
        return RouterTiming(
            self.poll_interval_s * factor,
            self.room_wait_s * factor,
            tuple(s * factor for s in self.room_backoff_s),
            self.cost_prior_scale * factor,
        )


class VirtualCluster:
    def __init__(
        self,
        deployment: Deployment,
        prefill_workers: int,
        decode_workers: int,
        router_config: RouterConfig,
        timing: RouterTiming = RouterTiming(),
        keep_tokens: bool = False,
        index_lag_s: float | None = None,
        router_replicas: int = 1,
        hybrid: bool = False,
    ) -> None:
        if router_replicas < 1:
            raise ValueError(f"router_replicas must be >= 1, got {router_replicas}")
        self.deployment = deployment
        self.timing = timing
        self.keep_tokens = keep_tokens
        self.loop = EventLoop()
        self.index = None if index_lag_s is None else VirtualIndex(self.loop, index_lag_s)
        self.workers: dict[str, VirtualWorker] = {}
        self._listeners: dict[str, dict[str, Listener]] = {}
        if hybrid and prefill_workers:
            raise ValueError("a hybrid cluster has no prefill-only workers")
        roles = [("prefill", i) for i in range(prefill_workers)]
        roles += [("hybrid" if hybrid else "decode", i) for i in range(decode_workers)]
        for role, i in roles:
            worker_id = f"{role}-{i}"
            sink = self.index.sink(worker_id) if self.index else None
            engine, meter = deployment.for_role(role).new_engine(sink)
            worker = VirtualWorker(worker_id, role, engine, meter, self.loop, self._dispatch)
            if self.index is not None:
                worker.step_listeners.append(lambda w=worker_id: self.index.step_ended(w))
            self.workers[worker_id] = worker
            self._listeners[worker_id] = {}
        by_role = {
            role: {w.worker_id: w for w in self.workers.values() if w.role == role}
            for role in ("prefill", "decode", "hybrid")
        }
        # The pool only holds snapshots here: it is never started, its handles never called.
        self.pool = WorkerPool(by_role["prefill"], by_role["decode"], hybrid=by_role["hybrid"])
        if router_replicas > 1:  # so each replica's policy knows it has peers
            router_config = replace(router_config, router_replicas=router_replicas)
        self.routers = [self._router(router_config, timing, r) for r in range(router_replicas)]
        for worker in self.workers.values():
            self._poll(worker)

    def _router(self, router_config: RouterConfig, timing: RouterTiming, replica: int) -> Routing:
        policy = RoutingPolicy(
            router_config,
            cost=CostModel.with_priors_scaled(timing.cost_prior_scale),
            seed=replica,  # the replicas' `random` picks are independent
        )
        policy.cost.step_tokens = self.deployment.engine_config.max_num_batched_tokens
        return Routing(
            self.pool,
            policy,
            self.deployment.engine_config.block_size,
            index=self.index,
            clock=lambda: self.loop.now,
            # Its memory of recent routes expires on the virtual clock too, not the wall's.
            recent=RecentPrefixes(clock=lambda: self.loop.now),
        )

    def router_of(self, request_index: int) -> Routing:
        """The replica that routes request `request_index` (the load balancer's rotation)."""
        return self.routers[request_index % len(self.routers)]

    def listen(self, worker: VirtualWorker, request_id: str, listener: Listener) -> None:
        """`listener(worker, output)` gets the request's outputs on `worker` until it finishes."""
        self._listeners[worker.worker_id][request_id] = listener

    def min_sampling_step_seconds(self) -> float:
        """No step of any worker that samples a token is shorter (0: no bound known)."""
        return min(w.min_sampling_step_seconds() for w in self.workers.values())

    def utilisation(self, role: str, elapsed_s: float) -> float:
        """Mean fraction of `elapsed_s` the workers of `role` (hybrid ones serve both) spent
        in steps (0 without any)."""
        busy = [w.busy_seconds for w in self.workers.values() if w.role in (role, "hybrid")]
        if not busy or elapsed_s <= 0:
            return 0.0
        return min(1.0, sum(busy) / len(busy) / elapsed_s)

    def peak_running(self) -> int:
        """The most sequences any worker had running after a step."""
        return max((w.peak_running for w in self.workers.values()), default=0)

    def _dispatch(self, worker: VirtualWorker, outputs: list[RequestOutput]) -> None:
        listeners = self._listeners[worker.worker_id]
        for out in outputs:
            if out.finished:
                listener = listeners.pop(out.request_id, None)
            else:
                listener = listeners.get(out.request_id)
            if listener is not None:
                listener(worker, out)

    def _poll(self, worker: VirtualWorker) -> None:
        """A stats poll of `worker` as WorkerPool._poll_forever runs it: the worker answers
        between two engine steps (its stats are an engine call, WorkerRuntime.stats), so a
        poll during a step waits for the step's end and sees the queue as it is then; the
        next poll is one interval after the answer."""

        sent_at = self.loop.now

        def answered(stats) -> None:
            self.pool.record_stats(self.pool.workers[worker.worker_id], stats, sent_at)
            self.loop.after(self.timing.poll_interval_s, lambda: self._poll(worker))

        worker.call(worker.stats, answered)
