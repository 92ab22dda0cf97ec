"""Chooses where each attempt of a request runs; the decision itself is router/policy.py's."""

from __future__ import annotations

from pdserve.config import RouterConfig
from router.request_flow import NoWorkerAvailable, Overloaded, Route
from router.worker_pool import Worker, WorkerPool


class Routing:
    def __init__(self, pool: WorkerPool, config: RouterConfig) -> None:
        self._pool = pool
        self._config = config

    def pending(self) -> int:
        return sum(w.inflight for w in self._pool.of_role("decode", healthy_only=False))

    def choose(self, prompt_ids: list[int], exclude: set[str]) -> Route:
        if self.pending() >= self._config.max_pending_requests:
            raise Overloaded(f"{self.pending()} requests in flight; the limit is "
                             f"{self._config.max_pending_requests}")
        decode = [w for w in self._pool.of_role("decode") if w.worker_id not in exclude]
        if not decode:
            raise NoWorkerAvailable("no healthy decode worker")
        prefill = [w for w in self._pool.of_role("prefill") if w.worker_id not in exclude]
        d = min(decode, key=_load)
        if self._config.disaggregate == "never" or not prefill:
            return Route(decode_worker=d.worker_id, prefill_worker=None)
        p = min(prefill, key=_load)
        return Route(decode_worker=d.worker_id, prefill_worker=p.worker_id)


def _load(worker: Worker) -> tuple[int, str]:
    return worker.inflight, worker.worker_id
