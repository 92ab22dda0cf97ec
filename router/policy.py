"""RoutingPolicy: per request, picks the decode worker, the prefill worker or a local prefill.

`decide` enumerates every option (each healthy P with each healthy D, and each D alone),
estimates it (router/estimates.py), drops the ones that cannot be taken now (admission control)
and picks one (the cost policy does the same on arrays, router/option_matrix.py):
  cost         minimum objective; options within `tie_tolerance` of the best are ties, broken
               by the cached prefix (prefill side, then decode side), then by the less loaded
               of two drawn at random: with a cheap model a cached prefix saves less than the
               tolerance, but reusing it still keeps the other workers' caches and time for
               other prefixes. Among options of
               the best's kind (remote or local) the tolerance is wide enough (0.05) that an
               idle worker's small lead over one running a few decodes is a tie: router
               replicas, each blind to the others' routes until the next poll, all sent to the
               idle one (docs/benchmarks/routing.md, sixth part); between kinds it is 0.005
  least_loaded the D with the fewest requests, then the P with the shortest prompt queue,
               exact ties in rotation (baseline, as nginx's least_conn)
  round_robin  D and P in rotation (baseline)
  prefix       the longest cached prefix on the prefilling worker, ties to the least loaded
               option (baseline: prefix affinity alone, as a prefix-cache scorer)
  approximate  sglang's and vllm-router's `cache_aware`: the least loaded option when loads
               are out of balance, else the longest cached prefix if it covers more than
               `APPROXIMATE_CACHE_THRESHOLD` of the prompt, else the least loaded; the router
               feeds it a cache view predicted from its own routes, no index
               (router/approximate_prefixes.py), so it measures what the index is worth
  random       any feasible option, uniformly (baseline)
`disaggregate`: auto = remote or local, whichever the policy prefers; always = remote (local only
when no prefill worker is healthy); never = local; threshold:N and conditional:LEN:QUEUE = the
field's rules choose the kind, the policy the workers (router/disaggregate_rule.py). When nothing can be taken the decision is a
rejection that the server answers with RESOURCE_EXHAUSTED (at once when the router is full; after
a brief wait for room when the workers are) or UNAVAILABLE (no healthy worker).
Pure Python, no I/O; not thread-safe (the router calls it from its event loop).
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pdserve.config import ROUTING_POLICIES, RouterConfig
from pdserve.disaggregate_modes import DisaggregateMode, parse_disaggregate
from router.cost_model import CostModel
from router.disaggregate_rule import option_kinds
from router.estimates import Estimate, RoutingRequest, Weights, WorkerLoad, estimate, objective
from router.load_rows import LoadRows
from router.option_matrix import LazyEstimates, Limits, OptionMatrix
from router.peer_pull import peer_blocks

POLICIES = ROUTING_POLICIES
T = TypeVar("T")
# The `approximate` policy's thresholds, sglang router's defaults for `cache_aware`: loads are
# out of balance when the busiest option's exceeds the idlest's by more than ABS requests and
# REL times; a cached prefix is followed when it covers more than the threshold of the prompt.
APPROXIMATE_CACHE_THRESHOLD = 0.5
APPROXIMATE_BALANCE_ABS = 32
APPROXIMATE_BALANCE_REL = 1.0001
# A rotation starts at a number drawn below this, which modulo a list of workers (far fewer)
# falls on any of them about evenly.
ROTATION_STARTS = 1 << 32
# Options whose objectives differ by less than this tie (router/option_matrix.py `cost_ties`).
# One router counts every request it routed since the last poll (`WorkerLoad.inflight`), so a
# gap of 0.01 (4 ms of TTFT at a 400 ms SLO) is real: at 0.05 a tenant's cold prefix landed on
# a worker whose warm turns then queued behind it, TTFT p90 34 against 17 ms for least-loaded
# cold picks (docs/benchmarks/routing.md, ninth part). Replicas each see only their own
# routes: 0.05 covers an idle worker's lead over one decoding a few requests, which all four
# replicas otherwise read alike and herd onto (sixth part).
TIE_TOLERANCE = 0.01
REPLICAS_TIE_TOLERANCE = 0.05


@dataclass
class RoutingDecision:
    # "ok"; rejected: "resource_exhausted" (the router is full), "at_capacity" (every option's
    # workers are full now: KV blocks, prompt queue) or "unavailable" (no healthy decode worker)
    status: str
    decode_worker: str | None = None
    prefill_worker: str | None = None  # None with status "ok": the decode worker prefills
    cached_tokens: int = 0  # prompt tokens the prefilling worker should find in its cache
    decode_cached_tokens: int = 0  # prompt tokens the decode worker already holds
    reason: str = ""  # why rejected (the client sees it), or how the choice was made
    chosen: Estimate | None = None
    # Every option, for tracing and tests (under the cost policy built on first access).
    estimates: Mapping[str, Estimate] = field(default_factory=dict)

    @property
    def accepted(self) -> bool:
        return self.status == "ok"

    @classmethod
    def reject(cls, reason: str, estimates: Mapping[str, Estimate] | None = None,
               status: str = "resource_exhausted") -> RoutingDecision:  # fmt: skip
        # `is None`, not `or`: a LazyEstimates would be built to be tested.
        return cls(status=status, reason=reason, estimates={} if estimates is None else estimates)


def _healthy(workers: Sequence[WorkerLoad]) -> Sequence[WorkerLoad]:
    """The healthy ones; the router's LoadRows as they are when all are (no copy)."""
    if isinstance(workers, LoadRows) and workers.all_healthy:
        return workers
    return [w for w in workers if w.healthy]


class RoutingPolicy:
    def __init__(
        self,
        config: RouterConfig,
        cost: CostModel | None = None,
        weights: Weights | None = None,
        tie_tolerance: float | None = None,
        kind_tie_tolerance: float = 0.005,
        vectorised: bool = True,
        seed: int | None = 0,
    ) -> None:
        """`vectorised`: the cost policy decides on router/option_matrix.py's arrays, O(P + D)
        Python; False enumerates every option as an Estimate (the reference it is tested against).
        `tie_tolerance`: None takes TIE_TOLERANCE, or REPLICAS_TIE_TOLERANCE when the config
        names router replicas.
        `seed`: of the policy's Random, which draws the `random` policy's picks and where the
        rotations start; None seeds it from system entropy (a real router: replicas side by
        side must not pick alike), a number repeats a run (tests, the simulation)."""
        if config.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {config.policy!r}")
        try:
            parse_disaggregate(config.disaggregate)
        except ValueError as e:
            raise ValueError(f"disaggregate {e}") from None
        if config.ttft_slo_ms <= 0 or config.tpot_slo_ms <= 0:
            raise ValueError("ttft_slo_ms and tpot_slo_ms must be > 0")
        self.config = config
        self.cost = cost or CostModel()
        self.weights = weights or Weights(tpot=config.tpot_weight)
        if tie_tolerance is None:
            replicas = config.router_replicas > 1
            tie_tolerance = REPLICAS_TIE_TOLERANCE if replicas else TIE_TOLERANCE
        self.tie_tolerance = tie_tolerance
        self.kind_tie_tolerance = kind_tie_tolerance
        self.vectorised = vectorised
        self._limits = Limits(
            ttft_slo_s=config.ttft_slo_ms / 1e3,
            tpot_slo_s=config.tpot_slo_ms / 1e3,
            max_queued_prefill_tokens=config.max_queued_prefill_tokens,
            weights=self.weights,
            peer_pull=config.peer_pull,
        )
        self._random = random.Random(seed)
        # The rotations start at a drawn place, not at the first worker: router replicas that
        # each count only their own requests would otherwise send to the same workers in step
        # (grpc-java's round robin picker starts at a random index for the same reason).
        self._turn = itertools.count(self._random.randrange(ROTATION_STARTS))  # ties, decode
        self._prefill_turn = itertools.count(self._random.randrange(ROTATION_STARTS))

    @property
    def mode(self) -> DisaggregateMode:
        """`--disaggregate` as parsed: read from the config at each decision, which may change
        while the router runs (parsed once per spec string)."""
        return parse_disaggregate(self.config.disaggregate)

    def overloaded(self, pending_requests: int) -> str | None:
        """Admission control: why one more request is refused, or None."""
        limit = self.config.max_pending_requests
        if pending_requests >= limit:
            return (
                f"router overloaded: {pending_requests} requests pending "
                f"(max_pending_requests={limit})"
            )
        return None

    def decide(
        self,
        request: RoutingRequest,
        prefill_workers: Sequence[WorkerLoad],
        decode_workers: Sequence[WorkerLoad],
        cached_blocks: Mapping[str, int] | None = None,
        pending_requests: int = 0,
    ) -> RoutingDecision:
        """`cached_blocks`: worker_id -> leading prompt blocks it holds (PrefixIndex.lookup;
        {} when unknown). `pending_requests`: requests the router holds now, this one excluded."""
        overloaded = self.overloaded(pending_requests)
        if overloaded:
            return RoutingDecision.reject(overloaded)
        decode, prefill = _healthy(decode_workers), _healthy(prefill_workers)
        if not decode:
            return RoutingDecision.reject("no healthy decode worker", status="unavailable")
        cached = dict(cached_blocks or {})
        if self.vectorised and self.config.policy == "cost":
            chosen = self._pick_vectorised(request, prefill, decode, cached)
            # Built later, from the loads of now (the router's rows change as it routes).
            p_now, d_now = list(prefill), list(decode)
            everything = LazyEstimates(lambda: self._options(request, p_now, d_now, cached))
            if chosen is not None:
                return self._accept(request, chosen, everything)
            # At capacity: the reasons alone, without pricing every option (in the offline
            # planner an overloaded probe's waiting requests retry, and pricing each rejection's
            # options took a quarter of its time). The same reasons as the enumeration's below,
            # which decides should they ever find an option the matrix did not.
            reasons = self._reasons(request, prefill, decode, cached)
            if reasons and None not in reasons:
                return RoutingDecision.reject(_at_capacity(reasons), everything,
                                              status="at_capacity")  # fmt: skip
        options = self._options(request, prefill, decode, cached)
        estimates = {o.name: o for o in options}
        feasible = [o for o in options if o.infeasible is None]
        if not feasible:
            reasons = {o.infeasible for o in options if o.infeasible}
            return RoutingDecision.reject(_at_capacity(reasons), estimates, status="at_capacity")
        return self._accept(request, self._pick(request, feasible, prefill, decode), estimates)

    def _accept(
        self, request: RoutingRequest, chosen: Estimate, estimates: Mapping[str, Estimate]
    ) -> RoutingDecision:
        bs = request.block_size
        return RoutingDecision(
            status="ok",
            decode_worker=chosen.decode_worker,
            prefill_worker=chosen.prefill_worker,
            cached_tokens=min(chosen.prefill_cached_blocks * bs, request.prompt_tokens - 1),
            decode_cached_tokens=chosen.decode_cached_blocks * bs,
            reason=f"{self.config.policy}: {chosen.name}",
            chosen=chosen,
            estimates=estimates,
        )

    def _options(
        self,
        request: RoutingRequest,
        prefill: list[WorkerLoad],
        decode: list[WorkerLoad],
        cached: dict[str, int],
    ) -> list[Estimate]:
        ttft_slo, tpot_slo = self._limits.ttft_slo_s, self._limits.tpot_slo_s
        peers = self._peer_blocks(request, decode, cached)
        options = []
        for p, d in self._pairs(request, prefill, decode, cached):
            est = estimate(request, p, d, cached, self.cost, peers.get(d.worker_id))
            est.infeasible = self._admission(
                request, est.decode_cached_blocks, est.prefill_cached_blocks, p, d
            )
            options.append((est, d))
        feasible = [est for est, _ in options if est.infeasible is None]
        best_ttft = min(est.ttft_s for est in feasible or [est for est, _ in options])
        for est, d in options:
            objective(est, request, d, self.cost, ttft_slo, tpot_slo, self.weights, best_ttft)
        return [est for est, _ in options]

    def _pick_vectorised(
        self,
        request: RoutingRequest,
        prefill: list[WorkerLoad],
        decode: list[WorkerLoad],
        cached: dict[str, int],
    ) -> Estimate | None:
        """The cost policy's pick (as `_pick`) over every option's arrays; None when no option
        can be taken (the enumeration then gives every reason)."""
        remote, local = option_kinds(self.mode, request, prefill, decode, cached)
        limits = self._limits
        matrix = OptionMatrix.build(
            request, prefill, decode, cached, self.cost, limits, remote=remote, local=local
        )
        if not matrix.feasible.any():
            return None
        ties = matrix.cost_ties(self.tie_tolerance, self.kind_tie_tolerance)
        load = matrix.load.ravel()
        p_at, d_at = matrix.workers(self._two_choices(list(ties), lambda at: load[at]))
        p, d = (prefill[p_at] if p_at is not None else None), decode[d_at]
        peer = self._peer_blocks(request, decode, cached).get(d.worker_id) if p is None else None
        chosen = estimate(request, p, d, cached, self.cost, peer)
        objective(chosen, request, d, self.cost, limits.ttft_slo_s, limits.tpot_slo_s,
                  self.weights, matrix.best_ttft_s)  # fmt: skip
        return chosen

    def _peer_blocks(
        self, request: RoutingRequest, decode: Sequence[WorkerLoad], cached: dict[str, int]
    ) -> dict[str, int]:
        """With --peer-pull, what each decode worker could pull from the others; else {}."""
        if not self.config.peer_pull:
            return {}
        workers = (d.worker_id for d in decode)
        return peer_blocks(workers, cached, request.prompt_tokens, request.block_size)

    def _reasons(
        self,
        request: RoutingRequest,
        prefill: list[WorkerLoad],
        decode: list[WorkerLoad],
        cached: dict[str, int],
    ) -> set[str]:
        """Why each option `_options` enumerates cannot be taken (None for those that can),
        from the cached prefixes `estimate` counts, without pricing the options."""
        full = request.full_blocks
        reasons = set()
        for p, d in self._pairs(request, prefill, decode, cached):
            d_cached = min(cached.get(d.worker_id, 0), full)
            p_cached = min(cached.get(p.worker_id, 0), full) if p else d_cached
            reasons.add(self._admission(request, d_cached, p_cached, p, d))
        return reasons

    def _pairs(
        self,
        request: RoutingRequest,
        prefill: Sequence[WorkerLoad],
        decode: Sequence[WorkerLoad],
        cached: Mapping[str, int],
    ) -> Iterator[tuple[WorkerLoad | None, WorkerLoad]]:
        """Every option as (prefill worker or None for local, decode worker), per decode
        worker its remote pairs then its local one, as the `--disaggregate` mode allows."""
        remote, local = option_kinds(self.mode, request, prefill, decode, cached)
        for d in decode:
            if remote:
                for p in prefill:
                    if p.worker_id != d.worker_id:  # a hybrid worker's own prefill is local
                        yield p, d
            if local:
                yield None, d

    def _admission(
        self,
        request: RoutingRequest,
        decode_cached_blocks: int,
        prefill_cached_blocks: int,
        p: WorkerLoad | None,
        d: WorkerLoad,
    ) -> str | None:
        """Why the option cannot be taken now, or None. Queues are bounded so that overload
        turns into fast rejections instead of ever-growing latency. The cached blocks: the
        option's estimate's."""
        needed = request.total_blocks - decode_cached_blocks
        if d.num_blocks and needed > d.num_free_blocks:
            return f"decode worker {d.worker_id} has {d.num_free_blocks} free KV blocks, needs {needed}"
        prefiller = p or d
        queued = prefiller.queued_tokens
        new = request.uncached_tokens(prefill_cached_blocks)
        limit = self.config.max_queued_prefill_tokens
        if queued and queued + new > limit:
            return (
                f"prefill queue of {prefiller.worker_id} full ({queued} tokens queued, max {limit})"
            )
        return None

    def _pick(
        self,
        request: RoutingRequest,
        feasible: list[Estimate],
        prefill: list[WorkerLoad],
        decode: list[WorkerLoad],
    ) -> Estimate:
        policy = self.config.policy
        if policy == "cost":
            best = min(feasible, key=lambda o: o.objective)
            ties = [o for o in feasible if o.objective <= best.objective + self._within(o, best)]
            first = min(map(self._tie_key, ties))
            ties = [o for o in ties if self._tie_key(o) == first]
            return self._two_choices(ties, lambda o: o.load)
        if policy == "prefix":
            return min(feasible, key=lambda o: (-o.prefill_cached_blocks, o.load, o.name))
        if policy == "approximate":
            return _pick_approximate(request, feasible)
        if policy == "random":
            return self._random.choice(feasible)
        by_decode: dict[str, list[Estimate]] = {}
        for o in feasible:
            by_decode.setdefault(o.decode_worker, []).append(o)
        loads = {w.worker_id: w for w in (*prefill, *decode)}
        if policy == "least_loaded":
            # Requests alone, exact ties in rotation, as nginx's least_conn: by name (or by
            # free KV blocks, which every replica reads from the same stats), replicas that
            # each count only their own requests would all send to the same idle worker.
            d_ids = _least(by_decode, lambda w: loads[w].load)
            choices = by_decode[d_ids[next(self._turn) % len(d_ids)]]
            ties = _least(choices, lambda o: self._prefill_load_key(o, loads))
            return ties[next(self._prefill_turn) % len(ties)]
        # round_robin: decode and prefill workers each in their own rotation.
        d_ids = sorted(by_decode)
        choices = by_decode[d_ids[next(self._turn) % len(d_ids)]]
        remote = sorted((o for o in choices if o.prefill_worker), key=lambda o: o.name)
        if not remote:
            return choices[0]  # the local option
        return remote[next(self._prefill_turn) % len(remote)]

    def _within(self, o: Estimate, best: Estimate) -> float:
        """How far above the best `o` still ties: where to prefill (remote or local) keeps the
        fine tolerance, only the choice among workers of the best's kind is widened."""
        same_kind = (o.prefill_worker is None) == (best.prefill_worker is None)
        return self.tie_tolerance if same_kind else self.kind_tie_tolerance

    def _two_choices(self, ties: list[T], load_of: Callable[[T], int]) -> T:
        """Of two ties drawn at random, the less loaded (the first drawn if equal): the power
        of two choices, as Envoy's least-request balancer. The least loaded of all would be the
        same worker in every router replica, which all read the same polled loads."""
        if len(ties) == 1:
            return ties[0]
        a, b = self._random.sample(range(len(ties)), 2)
        return ties[b] if load_of(ties[b]) < load_of(ties[a]) else ties[a]

    @staticmethod
    def _tie_key(o: Estimate) -> tuple[int, int]:
        return (-o.prefill_cached_blocks, -o.decode_cached_blocks)

    @staticmethod
    def _prefill_load_key(o: Estimate, loads: dict[str, WorkerLoad]) -> tuple:
        if o.prefill_worker is None:
            return (1, 0, 0)  # baselines prefer disaggregating when both are allowed
        p = loads[o.prefill_worker]
        return (0, p.queued_tokens, p.load)


def _least(items: Iterable[T], key: Callable[[T], Any]) -> list[T]:
    """The items of the least key, in their given order."""
    items = list(items)
    least = min(map(key, items))
    return [item for item in items if key(item) == least]


def _pick_approximate(request: RoutingRequest, feasible: list[Estimate]) -> Estimate:
    """`cache_aware`'s rule over the options (their `load`: the prefilling worker's requests)."""
    least_loaded = min(feasible, key=lambda o: (o.load, o.name))
    busiest = max(o.load for o in feasible)
    idlest = least_loaded.load
    if busiest - idlest > APPROXIMATE_BALANCE_ABS and busiest > idlest * APPROXIMATE_BALANCE_REL:
        return least_loaded
    best = min(feasible, key=lambda o: (-o.prefill_cached_blocks, o.load, o.name))
    if best.prefill_cached_blocks > APPROXIMATE_CACHE_THRESHOLD * max(1, request.full_blocks):
        return best
    return least_loaded


def _at_capacity(reasons: set[str | None]) -> str:
    """The rejection of a request no option can take: every option's reason, once each."""
    return "all workers at capacity: " + "; ".join(sorted(r for r in reasons if r))
