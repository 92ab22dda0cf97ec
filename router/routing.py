"""Chooses where each attempt of a request runs: gathers the inputs, router/policy.py decides.

Inputs are the workers' latest stats (polled by the WorkerPool), the router's own in-flight
counts (fresher than any poll), and each worker's cached prefix: from the Redis index (one round
trip; empty when Redis is down) merged with the prefixes the router itself sent each worker in
the last seconds (router/recent_prefixes.py), which the index cannot show until computed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from pdserve.core.block_hash import prompt_block_hashes
from pdserve.core.messages import PrefillResult, TokenBatch
from pdserve.prefix_index.lookup import PrefixIndex
from router.estimates import RoutingRequest, WorkerLoad
from router.policy import RoutingDecision, RoutingPolicy
from router.recent_prefixes import RecentPrefixes, merge
from router.request_flow import NoWorkerAvailable, Overloaded, Route
from router.worker_pool import Worker, WorkerPool

log = logging.getLogger(__name__)


@dataclass
class Routing:
    pool: WorkerPool
    policy: RoutingPolicy
    block_size: int
    index: PrefixIndex | None = None

    recent: RecentPrefixes = field(default_factory=RecentPrefixes)

    def __post_init__(self) -> None:
        self.pool.stats_listeners.append(self._learn_from_stats)
        self.last_decision: RoutingDecision | None = None
        # Prompt tokens each worker must still compute for requests routed since its last stats
        # poll: only the uncached part, so a cache hit does not make its holder look busy.
        self._routed_tokens: dict[str, int] = {}
        # Prefills routed to each worker so far: a prefill's timing is a sample of its compute
        # cost only if it ran alone (nothing queued when routed, nothing routed there until done).
        self._prefills_routed: dict[str, int] = {}

    def pending(self) -> int:
        return sum(w.inflight for w in self.pool.of_role("decode", healthy_only=False))

    def choose(self, prompt_ids: list[int], max_tokens: int, exclude: set[str]) -> Route:
        hashes = prompt_block_hashes(prompt_ids, self.block_size)
        indexed = self.index.lookup(hashes) if self.index is not None and hashes else {}
        cached = merge(indexed, self.recent.lookup(hashes, list(self.pool.workers)))
        prefill = [
            self._load(w)
            for w in self.pool.of_role("prefill", healthy_only=False)
            if w.worker_id not in exclude
        ]
        decode = [
            self._load(w)
            for w in self.pool.of_role("decode", healthy_only=False)
            if w.worker_id not in exclude
        ]
        bytes_per_block = next(
            (w.stats.bytes_per_block for w in self.pool.workers.values() if w.stats), 0
        )
        request = RoutingRequest(
            prompt_tokens=len(prompt_ids),
            max_tokens=max_tokens,
            block_size=self.block_size,
            bytes_per_block=bytes_per_block,
        )
        decision = self.policy.decide(
            request, prefill, decode, cached_blocks=cached, pending_requests=self.pending()
        )
        self.last_decision = decision
        if decision.status == "resource_exhausted":
            raise Overloaded(decision.reason)
        if decision.status != "ok":
            raise NoWorkerAvailable(decision.reason)
        self._remember(decision, request, hashes)
        estimates = {
            "chosen": decision.reason,
            "cached_blocks": cached,
            "cached_tokens": decision.cached_tokens,
            "decode_cached_tokens": decision.decode_cached_tokens,
        }
        if decision.chosen is not None:
            estimates["estimate"] = decision.chosen
        if decision.prefill_worker:
            estimates["block_hashes"] = hashes  # credited to the decode worker on commit
            p = next(w for w in prefill if w.worker_id == decision.prefill_worker)
            if not (p.load or p.queued_tokens):  # idle when routed: its timing may be sampled
                estimates["prefills_routed"] = self._prefills_routed[decision.prefill_worker]
        return Route(
            decode_worker=decision.decode_worker,
            prefill_worker=decision.prefill_worker,
            estimates=estimates,
        )

    def on_prefill_done(self, route: Route, result: PrefillResult | TokenBatch) -> None:
        """Learns the prefill's cost; records prefix reuse (hit and miss tokens) of the worker
        that computed the prompt."""
        hit = result.num_cached_tokens
        if route.prefill_worker and isinstance(result, PrefillResult):
            # The cost of exactly what the policy estimates, so only from a prefill that had its
            # worker to itself: one admitted beside others shares their steps (its queue_s stays
            # 0 while its prefill_s grows with their work), and the fit learned the load as if
            # it were compute: an intercept of a whole busy period, a cached prefix saving almost
            # nothing, and the queue counted twice. A local prefill's time includes its queue,
            # so it is not sampled here either.
            routed = route.estimates.get("prefills_routed")
            if routed is not None and routed == self._prefills_routed.get(route.prefill_worker):
                self.policy.cost.observe_request_prefill(
                    result.num_prompt_tokens - hit, result.prefill_s
                )
            # The push has committed: from now on the decode worker holds the prompt's blocks.
            self.recent.add(route.decode_worker, route.estimates.get("block_hashes", []))
        if self.index is None:
            return
        worker = route.prefill_worker or route.decode_worker
        self.index.record_reuse(worker, hit, max(0, result.num_prompt_tokens - hit))

    def _remember(
        self, decision: RoutingDecision, request: RoutingRequest, hashes: list[int]
    ) -> None:
        """What the chosen workers will hold and compute, before any poll or index shows it."""
        prefiller = decision.prefill_worker or decision.decode_worker
        uncached = request.uncached_tokens(decision.chosen.prefill_cached_blocks)
        self._routed_tokens[prefiller] = self._routed_tokens.get(prefiller, 0) + uncached
        self._prefills_routed[prefiller] = self._prefills_routed.get(prefiller, 0) + 1
        # The prefilling worker caches the prompt's full blocks, and a request queued behind it
        # there reuses them (the scheduler computes a shared prefix once). A decode worker
        # receiving them holds them only once the push commits (`on_prefill_done`): crediting it
        # now would make a local prefill there look cheap while it would compute the whole prompt.
        self.recent.add(prefiller, hashes)

    def _load(self, worker: Worker) -> WorkerLoad:
        if worker.stats is None:
            return WorkerLoad(worker.worker_id, healthy=False)
        return WorkerLoad.from_stats(
            worker.stats,
            healthy=worker.healthy,
            inflight=worker.routed_since_poll,
            inflight_prompt_tokens=self._routed_tokens.get(worker.worker_id, 0),
        )

    def _learn_from_stats(self, worker: Worker, previous, stats) -> None:
        self._routed_tokens[worker.worker_id] = 0  # the new snapshot's queue includes them
        if previous is not None and previous.epoch != stats.epoch:
            self.recent.forget(worker.worker_id)
        self.policy.cost.observe_stats(stats)
