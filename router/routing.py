"""Chooses where each attempt of a request runs: gathers the inputs, router/policy.py decides.

Inputs are the workers' latest stats (polled by the WorkerPool), the router's own in-flight
counts (fresher than any poll), and each worker's cached prefix: from the Redis index (one round
trip, awaited without holding the event loop in `choose_async`; empty when Redis is down) merged
with the prefixes the router itself sent each worker in the last seconds
(router/recent_prefixes.py), which the index cannot show until computed. Under the
`approximate` policy the index is not asked: each worker's cache is predicted from the routes
alone (router/approximate_prefixes.py), as routers without KV events do.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pdserve.core.messages import PrefillResult, TokenBatch, WorkerStats
from pdserve.core.prompt_tokens import block_hashes_of
from router.approximate_prefixes import ApproximatePrefixes
from router.bounded_pool import BoundedPool
from router.estimates import RoutingRequest, WorkerLoad
from router.load_rows import LoadRows
from router.peer_pull import plan_pull
from router.policy import RoutingDecision, RoutingPolicy
from router.recent_prefixes import RecentPrefixes, merge
from router.types import AtCapacity, NoWorkerAvailable, Overloaded, Route
from router.waiting import WaitingRequests
from router.worker_pool import Worker, WorkerPool

if TYPE_CHECKING:  # the Redis client; the offline planner (pdserve/planner) routes without it
    from pdserve.prefix_index.lookup import PrefixIndex

log = logging.getLogger(__name__)


@dataclass
class Routing:
    pool: WorkerPool
    policy: RoutingPolicy
    block_size: int
    index: PrefixIndex | None = None
    # Whether a decode worker keeps the KV pushed to it in its prefix cache
    # (`KVTransferConfig.caches_received_kv`); if not, a push teaches the router nothing.
    decode_caches_received_kv: bool = True
    # When things happen, on the pool's clock (the offline planner's: its virtual clock).
    clock: Callable[[], float] = time.monotonic

    recent: RecentPrefixes = field(default_factory=RecentPrefixes)
    approximate: ApproximatePrefixes = field(default_factory=ApproximatePrefixes)
    # Where requests wait before (or between) their attempts: the router's CPU pools
    # (tokenizing, body decoding) and RequestFlow's wait for room; the router holds those
    # requests too (`count`).
    queues: list[BoundedPool | WaitingRequests] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.pool.stats_listeners.append(self._learn_from_stats)
        self.pool.unhealthy_listeners.append(self._load)
        # What was routed to each worker since the poll behind its snapshot was sent: load the
        # snapshot cannot show. Tokens are the prompt tokens to compute, only the uncached
        # part, so a cache hit does not make its holder look busy.
        self._routed_since_poll: dict[str, _Routed] = {}
        # Prefills routed to each worker so far: a prefill's timing is a sample of its compute
        # cost only if it ran alone (nothing queued when routed, nothing routed there until done).
        self._prefills_routed: dict[str, int] = {}
        # What each worker's last WorkerLoad was made of (stats snapshot, health, routed requests,
        # tokens and blocks), to make it again only when one changed. The snapshot is compared by
        # identity: a poll stores a new WorkerStats (Ray and the planner's VirtualWorker.stats
        # both make one), never edits one.
        self._load_inputs: dict[str, tuple[WorkerStats, bool, int, int, int]] = {}
        # The distinct blocks routed to each worker within RecentPrefixes' TTL, as of its last
        # poll (WorkerLoad.recent_blocks).
        self._recent_blocks: dict[str, int] = {}
        # Each role's loads in pool order, a worker's row replaced as its load changes (a poll's
        # answer, a routed or computed prompt, a change of health: `_load`'s callers), so a
        # decision reads every worker without touching each one.
        self.roles_changed()

    def roles_changed(self) -> None:
        """Makes each role's rows again from the pool: after a worker started draining or
        changed role (router/role_switch.py)."""
        self._rows = {
            role: LoadRows(w.worker_id for w in self.pool.of_role(role, healthy_only=False))
            for role in ("prefill", "decode")
        }
        # The rows each worker's load is kept in (a hybrid worker's: both roles'), found once
        # here rather than at each of `_load`'s calls (every poll answer and routed prompt).
        self._rows_of = {
            worker_id: [rows for rows in self._rows.values() if worker_id in rows.position]
            for worker_id in self.pool.workers
        }
        self._load_inputs.clear()
        for worker in self.pool.workers.values():
            self._load(worker)

    def pending(self) -> int:
        """Requests the router holds: in flight on the workers, or in one of its queues (a
        request is in one place at a time: tokenized, then routed, waiting for room between
        attempts)."""
        return self.pool.inflight("decode") + sum(q.outstanding for q in self.queues)

    def count(self, queue: BoundedPool | WaitingRequests) -> None:
        """Counts `queue`'s requests as pending; it takes none while max_pending_requests are
        pending, the same refusal (RESOURCE_EXHAUSTED / 429) as routing's."""
        self.queues.append(queue)
        queue.admission = self.admit

    def pending_stages(self) -> dict[str, Callable[[], int]]:
        """Where the pending requests are, each stage's count read live: `workers` (in flight
        there) and each queue by its name (tokenize, request_body, waiting_for_room)."""
        stages = {"workers": lambda: self.pool.inflight("decode")}
        for name in {q.name for q in self.queues}:
            stages[name.replace(" ", "_")] = lambda name=name: sum(
                q.outstanding for q in self.queues if q.name == name
            )
        return stages

    def admit(self) -> None:
        """Overloaded when max_pending_requests are pending already."""
        overloaded = self.policy.overloaded(self.pending())
        if overloaded:
            raise Overloaded(overloaded)

    async def choose_async(
        self, prompt_ids: list[int], max_tokens: int, exclude: set[str]
    ) -> Route:
        """`choose` for a caller on an event loop (the router's request flow): the loop serves
        other requests while Redis answers the lookup; the decision is then made from the
        loads of that moment."""
        hashes = block_hashes_of(prompt_ids, self.block_size)  # remembered by PromptTokens
        indexed = await self.index.lookup_async(hashes) if self._asks_index() else {}
        return self._decide(prompt_ids, hashes, indexed, max_tokens, exclude)

    def choose(self, prompt_ids: list[int], max_tokens: int, exclude: set[str]) -> Route:
        """The same, the lookup made in this thread (the offline planner has no index)."""
        hashes = block_hashes_of(prompt_ids, self.block_size)
        indexed = self.index.lookup(hashes) if self._asks_index() else {}
        return self._decide(prompt_ids, hashes, indexed, max_tokens, exclude)

    def _approximates(self) -> bool:
        return self.policy.config.policy == "approximate"

    def _asks_index(self) -> bool:
        return self.index is not None and not self._approximates()

    def _decide(
        self,
        prompt_ids: list[int],
        hashes: Sequence[int],
        indexed: dict[str, int],
        max_tokens: int,
        exclude: set[str],
    ) -> Route:
        if self._approximates():
            cached = self.approximate.lookup(hashes, self.pool.workers.keys())
        else:
            cached = merge(indexed, self.recent.lookup(hashes, self.pool.workers.keys()))
        prefill: Sequence[WorkerLoad] = self._rows["prefill"]
        decode: Sequence[WorkerLoad] = self._rows["decode"]
        if exclude:  # a retry: the failed workers are not options
            prefill = [load for load in prefill if load.worker_id not in exclude]
            decode = [load for load in decode if load.worker_id not in exclude]
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
        if decision.status == "at_capacity":
            raise AtCapacity(decision.reason)
        if decision.status == "resource_exhausted":
            raise Overloaded(decision.reason)
        if decision.status == "unavailable":  # name what became of the decode workers
            raise NoWorkerAvailable(self.pool.why_unavailable("decode", exclude))
        if decision.status != "ok":
            raise NoWorkerAvailable(decision.reason)
        prefiller_idle = False  # read before `_remember` counts this request there
        if decision.prefill_worker:
            p = self._rows["prefill"].of(decision.prefill_worker)
            prefiller_idle = not (p.load or p.queued_tokens)
        pull = None
        if self.policy.config.peer_pull and not decision.prefill_worker:
            holders = [load.worker_id for load in decode if load.healthy]
            pull = plan_pull(
                self.policy.cost,
                decision.decode_worker,
                len(prompt_ids),
                self.block_size,
                bytes_per_block,
                cached,
                holders,
            )
        routed = self._remember(decision, request, hashes)
        prefills_routed = None
        if prefiller_idle:  # idle when routed: its timing may be sampled
            prefills_routed = self._prefills_routed[decision.prefill_worker]
        return Route(
            decode_worker=decision.decode_worker,
            prefill_worker=decision.prefill_worker,
            reason=decision.reason,
            cached_tokens=decision.cached_tokens,
            decode_cached_tokens=decision.decode_cached_tokens,
            cached_blocks=cached,
            estimate=decision.chosen,
            block_hashes=tuple(hashes) if decision.prefill_worker else (),
            prefills_routed=prefills_routed,
            routed=routed,
            peer_pull=pull,
        )

    def on_prefill_done(self, route: Route, result: PrefillResult | TokenBatch) -> None:
        """Learns the prefill's cost; records prefix reuse (hit and miss tokens) of the worker
        that computed the prompt."""
        hit = result.num_cached_tokens
        self.on_prompt_computed(route)  # a local prefill's; a remote one's first answer did it
        if route.prefill_worker and isinstance(result, PrefillResult):
            # A prefill admitted beside others shares their engine steps (its queue_s stays 0
            # while its prefill_s grows with their work), so only one that had its worker to
            # itself measures what the policy estimates. A local prefill's time includes its
            # queue, so it is not sampled here either.
            routed = route.prefills_routed
            if routed is not None and routed == self._prefills_routed.get(route.prefill_worker):
                hybrid = self.pool.workers[route.prefill_worker].role == "hybrid"
                self.policy.cost.observe_request_prefill(
                    result.num_prompt_tokens - hit, result.prefill_s, local=hybrid
                )
            if route.first_answer_at and route.routed is not None:
                # Routed -> first answer, less what the prefill worker's queue and compute
                # took (priced apart): the handoff's round trips, which a local prefill skips.
                took = route.first_answer_at[0] - route.routed[0]
                self.policy.cost.observe_handoff(took - result.queue_s - result.prefill_s)
            if self.decode_caches_received_kv:
                # The push has committed: the decode worker now holds the prompt's blocks.
                self.recent.add(route.decode_worker, route.block_hashes)
                if self._approximates():
                    self._predict_held(route.decode_worker, route.block_hashes)
        if self.index is None:
            return
        worker = route.prefill_worker or route.decode_worker
        # Called on the router's event loop: the write goes to the index's writer thread.
        self.index.in_background(
            self.index.record_reuse, worker, hit, max(0, result.num_prompt_tokens - hit)
        )

    def on_prompt_computed(self, route: Route) -> None:
        """The route's prompt is computed (a remote prefill's first answer, before its push):
        the prefilling worker's queue no longer holds it, which the next poll, up to an
        interval away, would be the first to show. Until then the policy saw an idle prefill
        worker as busy with it, and prefilled locally instead. Idempotent."""
        if route.prefill_worker and not route.first_answer_at:
            route.first_answer_at.append(self.clock())
        worker_id = route.prefill_worker or route.decode_worker
        routed = self._routed_since_poll.get(worker_id)
        if routed is not None and route.routed is not None:
            routed.computed(route.routed, stays=route.prefill_worker is None)
            self._load(self.pool.workers[worker_id])

    def on_output_computed(self, route: Route, computed_ids: Sequence[int]) -> None:
        """A request finished: its decode worker cached the KV of `computed_ids` (its prompt
        and all but the last output token), which the index shows only once that worker's
        events arrive. A conversation's next turn, sent at once, starts with them: remembered
        here, it finds that worker meanwhile."""
        if route.prefill_worker and not self.decode_caches_received_kv:
            return  # the prompt's blocks are not cached there, so neither are the output's
        hashes = block_hashes_of(computed_ids, self.block_size)
        self.recent.add(route.decode_worker, hashes)
        if self._approximates():
            self._predict_held(route.decode_worker, hashes)

    def _remember(
        self, decision: RoutingDecision, request: RoutingRequest, hashes: Sequence[int]
    ) -> tuple[float, int, int]:
        """What the chosen workers will hold and compute, before any poll or index shows it.
        Returns the prefilling worker's entry (when, prompt tokens to compute, KV blocks)."""
        prefiller = decision.prefill_worker or decision.decode_worker
        chosen, now = decision.chosen, self.clock()
        # The decode worker holds the prompt's blocks it lacks and the output's; a prefill
        # worker's are its cache once pushed (free to allocate, as the snapshot counts them).
        blocks = request.decode_blocks(chosen.decode_cached_blocks)
        tokens = request.uncached_tokens(chosen.prefill_cached_blocks)
        local = decision.decode_worker == prefiller
        entry = (now, tokens, blocks if local else 0)
        self._routed(prefiller).add(entry)
        self._load(self.pool.workers[prefiller])
        if not local:
            self._routed(decision.decode_worker).add((now, 0, blocks))  # joins its batch later
            self._load(self.pool.workers[decision.decode_worker])
        self._prefills_routed[prefiller] = self._prefills_routed.get(prefiller, 0) + 1
        # The prefilling worker caches the prompt's full blocks, and a request queued behind it
        # there reuses them (the scheduler computes a shared prefix once). A decode worker
        # receiving them holds them only once the push commits (`on_prefill_done`): crediting it
        # now would make a local prefill there look cheap while it would compute the whole prompt.
        self.recent.add(prefiller, hashes)
        if self._approximates():
            self._predict_held(prefiller, hashes)
        return entry

    def _predict_held(self, worker_id: str, hashes: Sequence[int]) -> None:
        stats = self.pool.workers[worker_id].stats
        self.approximate.add(worker_id, hashes, stats.num_blocks if stats else 0)

    def _routed(self, worker_id: str) -> _Routed:
        return self._routed_since_poll.setdefault(worker_id, _Routed())

    def _load(self, worker: Worker) -> WorkerLoad:
        """The worker's WorkerLoad now; made anew, and set as its row, when its inputs changed."""
        # A draining worker (role switching) is routable to nothing, as an unhealthy one.
        stats, healthy = worker.stats, worker.routable
        rows = self._rows_of[worker.worker_id]  # a hybrid worker's: both roles', one WorkerLoad
        if stats is None:  # never polled: its row is still the unhealthy placeholder
            return rows[0].of(worker.worker_id)
        routed = self._routed_since_poll.get(worker.worker_id)
        requests, tokens, blocks = (
            (routed.requests, routed.tokens, routed.blocks) if routed else (0, 0, 0)
        )
        known = self._load_inputs.get(worker.worker_id)
        if (
            known is not None
            and known[0] is stats
            and known[1] == healthy
            and known[2:] == (requests, tokens, blocks)
        ):
            return rows[0].of(worker.worker_id)
        load = WorkerLoad.from_stats(
            stats, healthy=healthy, inflight=requests, inflight_prompt_tokens=tokens,
            inflight_blocks=blocks, recent_blocks=self._recent_blocks.get(worker.worker_id, 0),
        )  # fmt: skip
        self._load_inputs[worker.worker_id] = (stats, healthy, requests, tokens, blocks)
        for role_rows in rows:
            role_rows.set(load)
        return load

    def _learn_from_stats(
        self, worker: Worker, previous: WorkerStats | None, stats: WorkerStats
    ) -> None:
        # A poll answered during an engine step was taken at the step's end, before the adds
        # queued behind it: what was routed after the poll was sent is not in it yet.
        routed = self._routed_since_poll.get(worker.worker_id)
        if routed is not None:
            routed.forget_until(worker.poll_sent_at)
        if previous is not None and previous.epoch != stats.epoch:
            self.recent.forget(worker.worker_id)
            self.approximate.forget(worker.worker_id)
        self.policy.cost.observe_stats(stats)
        # Counted as each poll arrives, with the snapshot it goes with: a scan of the worker's
        # remembered blocks, which made the decision p99 at 64 workers 0.42 -> 0.56-0.81 ms when
        # made with every route (the blocks routed since the poll are `inflight_blocks`). Not
        # for a prefill-only worker: KV pressure is charged where requests decode, and its
        # table, every prompt sent there, is the longest to scan.
        decodes = worker.role != "prefill"
        recent = self.recent.remembered_blocks(worker.worker_id) if decodes else 0
        self._recent_blocks[worker.worker_id] = recent
        self._load(worker)  # as its answer arrives: no decision makes it


@dataclass
class _Routed:
    """Routed to one worker and not yet in its stats snapshot: (when, prompt tokens to
    compute there, KV blocks it will hold there) each."""

    entries: list[tuple[float, int, int]] = field(default_factory=list)
    # The entries' count, prompt tokens and blocks, kept as they change: every routing
    # decision reads them for every worker, polls change them a few times a second.
    requests: int = 0
    tokens: int = 0
    blocks: int = 0

    def add(self, entry: tuple[float, int, int]) -> None:
        self.entries.append(entry)
        self.requests += 1
        self.tokens += entry[1]
        self.blocks += entry[2]

    def computed(self, entry: tuple[float, int, int], stays: bool) -> None:
        """The prompt of `entry` is computed: its tokens no longer queue here, nor does its
        request unless it `stays` (a local prefill goes on to decode here). Nothing when a
        poll has dropped it already (equal entries are interchangeable)."""
        try:
            i = self.entries.index(entry)
        except ValueError:
            return
        self.tokens -= entry[1]
        if stays:  # its blocks too: held there until a snapshot shows them
            self.entries[i] = (entry[0], 0, entry[2])
        else:
            del self.entries[i]
            self.requests -= 1
            self.blocks -= entry[2]

    def forget_until(self, sent_at: float | None) -> None:
        """Drops what a snapshot from a poll sent at `sent_at` includes (None: everything)."""
        self.entries = [e for e in self.entries if sent_at is not None and e[0] > sent_at]
        self.requests = len(self.entries)
        self.tokens = sum(e[1] for e in self.entries)
        self.blocks = sum(e[2] for e in self.entries)
