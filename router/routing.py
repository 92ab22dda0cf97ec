"""Chooses where each attempt of a request runs: gathers the inputs, router/policy.py decides.

Inputs are the workers' latest stats (polled by the WorkerPool), the router's own in-flight
counts (fresher than any poll), and each worker's cached prefix from the Redis index (one round
trip; empty when Redis is down, and the policy then routes on load alone).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from pdserve.block_hash import prompt_block_hashes
from pdserve.messages import PrefillResult, TokenBatch
from router.estimates import RoutingRequest, WorkerLoad
from router.policy import RoutingDecision, RoutingPolicy
from router.prefix_index import PrefixIndex
from router.request_flow import NoWorkerAvailable, Overloaded, Route
from router.worker_pool import Worker, WorkerPool

log = logging.getLogger(__name__)


@dataclass
class Routing:
    pool: WorkerPool
    policy: RoutingPolicy
    block_size: int
    index: PrefixIndex | None = None

    def __post_init__(self) -> None:
        self.pool.stats_listeners.append(self._learn_from_stats)
        self.last_decision: RoutingDecision | None = None

    def pending(self) -> int:
        return sum(w.inflight for w in self.pool.of_role("decode", healthy_only=False))

    def choose(self, prompt_ids: list[int], max_tokens: int, exclude: set[str]) -> Route:
        hashes = prompt_block_hashes(prompt_ids, self.block_size)
        cached = self.index.lookup(hashes) if self.index is not None and hashes else {}
        prefill = [self._load(w) for w in self.pool.of_role("prefill", healthy_only=False)
                   if w.worker_id not in exclude]
        decode = [self._load(w) for w in self.pool.of_role("decode", healthy_only=False)
                  if w.worker_id not in exclude]
        bytes_per_block = next((w.stats.bytes_per_block for w in self.pool.workers.values()
                                if w.stats), 0)
        request = RoutingRequest(prompt_tokens=len(prompt_ids), max_tokens=max_tokens,
                                 block_size=self.block_size, bytes_per_block=bytes_per_block)
        decision = self.policy.decide(request, prefill, decode, cached_blocks=cached,
                                      pending_requests=self.pending())
        self.last_decision = decision
        if decision.status == "resource_exhausted":
            raise Overloaded(decision.reason)
        if decision.status != "ok":
            raise NoWorkerAvailable(decision.reason)
        estimates = {"chosen": decision.reason, "cached_blocks": cached,
                     "cached_tokens": decision.cached_tokens,
                     "decode_cached_tokens": decision.decode_cached_tokens}
        if decision.chosen is not None:
            estimates["estimate"] = decision.chosen
        return Route(decode_worker=decision.decode_worker,
                     prefill_worker=decision.prefill_worker, estimates=estimates)

    def on_prefill_done(self, route: Route, result: PrefillResult | TokenBatch) -> None:
        """Records prefix reuse (hit and miss tokens) of the worker that computed the prompt."""
        if self.index is None:
            return
        worker = route.prefill_worker or route.decode_worker
        hit = result.num_cached_tokens
        self.index.record_reuse(worker, hit, max(0, result.num_prompt_tokens - hit))

    def _load(self, worker: Worker) -> WorkerLoad:
        if worker.stats is None:
            return WorkerLoad(worker.worker_id, healthy=False)
        return WorkerLoad.from_stats(worker.stats, healthy=worker.healthy,
                                     inflight=worker.routed_since_poll,
                                     inflight_prompt_tokens=worker.routed_tokens_since_poll)

    def _learn_from_stats(self, worker: Worker, previous, stats) -> None:
        self.policy.cost.observe_stats(stats)
