"""The cost policy's decision over every option at once, as numpy arrays: O(P + D) Python.

RoutingPolicy enumerates each option (P, D) and each local D as an Estimate, ~27 us of Python
apiece: 240 ms for 64 prefill x 192 decode workers. An option's numbers are separable: TTFT of
(P, D) is A(P) (queue + compute on P) + B(D) (transfer of the blocks D lacks), and every other
term, as well as admission, belongs to P alone or to D alone. So the per-worker terms are
computed once per worker as vectors and combined as a D x (P + 1) matrix (rows: decode
workers in order; columns: prefill workers in order, then the local option), flattened in the
order the policy enumerates options.

Every element is the same IEEE operations, in the same order, as router/estimates.py's
`estimate` and `objective` (and router/cost_model.py's lines) compute for that option, so the
objectives are equal bit for bit and the pick (minimum, ties within the tolerance, tie key,
random draws) is the policy's own. tests/router/test_option_matrix.py checks it against the
enumeration on random loads and caches. Only the chosen option becomes an Estimate; the
estimate of every option (for tracing and tests) is built on first access.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from router.cost_model import CostModel
from router.cost_vectors import line, prefill_seconds, queue_seconds, stall_seconds
from router.estimates import (
    Estimate,
    RoutingRequest,
    Weights,
    WorkerLoad,
    certain_stall_misses,
)
from router.load_rows import LoadRows
from router.peer_pull import PULL_MARGIN
from router.worker_vectors import WorkerVectors, max_of_others, uncached_tokens


class LazyEstimates(Mapping[str, Estimate]):
    """option name -> Estimate, enumerated on first access (the decision does not need it)."""

    def __init__(self, build: Callable[[], list[Estimate]]) -> None:
        self._build = build
        self._estimates: dict[str, Estimate] | None = None

    def _all(self) -> dict[str, Estimate]:
        if self._estimates is None:
            self._estimates = {o.name: o for o in self._build()}
        return self._estimates

    def __getitem__(self, name: str) -> Estimate:
        return self._all()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._all())

    def __len__(self) -> int:
        return len(self._all())


# Finding the dominated prefill workers costs ~12 numpy calls over P x P; it saves work over
# the D x P pairs. Measured per build: 8 x 8 workers, +40 us with it; 16 x 48 and 32 x 96, even;
# 64 x 192, 190 us with it and 740 us without.
PRUNE_FROM_PAIRS = 512


@dataclass(frozen=True)
class Limits:
    """The policy's settings that enter an option's objective and admission."""

    ttft_slo_s: float
    tpot_slo_s: float
    max_queued_prefill_tokens: int
    weights: Weights
    peer_pull: bool = False  # a local prefill may pull a peer's longer prefix (--peer-pull)


@dataclass
class OptionMatrix:
    objective: np.ndarray  # D x C, C = P + 1 (the last column: local) or P or 1
    feasible: np.ndarray  # D x C, admission passed
    prefill_cached: np.ndarray  # D x C, blocks the prefilling worker holds
    decode_cached: np.ndarray  # D, blocks the decode worker holds
    load: np.ndarray  # D x C
    best_ttft_s: float  # the lowest TTFT of a feasible option (inf when none)
    # Position in `prefill` of each remote column; a further column is the local option.
    prefill_positions: np.ndarray

    @classmethod
    def build(
        cls,
        request: RoutingRequest,
        prefill: Sequence[WorkerLoad],
        decode: Sequence[WorkerLoad],
        cached: dict[str, int],
        cost: CostModel,
        limits: Limits,
        *,
        remote: bool,
        local: bool,
        prune: bool | None = None,
    ) -> OptionMatrix:
        """`prune`: drop the columns of prefill workers that another one dominates (see
        `_undominated`): the cost policy's pick is the same, the matrix smaller. None: when
        that pays, from PRUNE_FROM_PAIRS prefill x decode pairs.

        At a few workers each numpy call costs more than its arithmetic (~1 us on a tiny
        array), so the calls are few: both pools' loads are one table, the per-worker terms
        both pools share (uncached tokens, prompt-queue admission) one vector over it, and the
        objective one expression over the whole D x C matrix, whose columns are filled in place.
        """
        w, full, total = limits.weights, request.full_blocks, request.total_blocks
        prefill = prefill if remote else []
        n_p, n_d = len(prefill), len(decode)
        both = WorkerVectors.of(prefill, decode, cached, full)  # prefill rows, then decode rows
        p, d = both.rows(slice(0, n_p)), both.rows(slice(n_p, None))
        uncached = uncached_tokens(request, both.cached)
        queue_ok = _queue_ok(both, uncached, limits)  # admission of each worker as prefiller

        slo_t, slo_p = limits.ttft_slo_s, limits.tpot_slo_s
        before = d.running + d.queued_requests  # D's batch without this request
        tpot = line(cost.decode, before + 1)
        missing = total - d.cached  # blocks of the prompt D lacks
        # Decode-side admission: room for the blocks it lacks.
        d_ok = (d.num_blocks == 0) | (missing <= d.free)
        slowdown = tpot - line(cost.decode, np.maximum(1, before))
        interference = d.running * np.maximum(0.0, slowdown)  # to D's running requests
        amortize = max(1, min(w.stall_amortize_tokens, request.max_tokens))

        keep = np.arange(0)  # the prefill workers paired, by position in `prefill`
        if n_p:  # remote: TTFT = (queue + compute on P) + transfer to D (see estimate); no stall
            p_compute = prefill_seconds(cost, uncached[:n_p], local=False)
            p_wait = queue_seconds(cost, p.queued_tokens, p.queued_requests, local=False)
            hybrid = bool(p.hybrid.any())
            if hybrid:  # priced as a decode worker's own queue and prefill (`estimate`)
                is_hybrid = p.hybrid != 0
                local_compute = prefill_seconds(cost, uncached[:n_p], local=True)
                local_wait = queue_seconds(cost, p.queued_tokens, p.queued_requests, local=True)
                p_compute = np.where(is_hybrid, local_compute, p_compute)
                p_wait = np.where(is_hybrid, local_wait, p_wait)
            p_ttft = p_wait + p_compute
            p_compute_term = w.compute * p_compute / slo_t
            p_ok = queue_ok[:n_p]
            p_harm, p_miss = _hybrid_stalls(cost, p, uncached[:n_p], amortize, limits)
            keep = np.arange(n_p)
            # With hybrid workers an option is not P's alone to dominate: (P, P) is not one.
            if not hybrid and (prune or (prune is None and n_p * n_d >= PRUNE_FROM_PAIRS)):
                keep = keep[_undominated(p_ttft, p_compute_term, p_ok, p.cached)]
        k = len(keep)
        columns = k + local
        ttft = np.empty((n_d, columns))
        compute = np.empty((n_d, columns))  # the objective's compute term
        harm_term = np.empty((n_d, columns))  # the objective's interference term
        feasible = np.empty((n_d, columns), dtype=bool)
        p_cached = np.empty((n_d, columns), dtype=np.int64)
        load = np.empty((n_d, columns), dtype=np.int64)
        stall_miss = np.zeros((n_d, columns))  # D's TPOT beyond the SLO x the stalled, capped
        if k:
            transfer = line(cost.transfer, missing * request.bytes_per_block)
            np.add(p_ttft[keep], transfer[:, None], out=ttft[:, :k])
            ttft[:, :k] += cost.handoff_seconds()
            compute[:, :k] = p_compute_term[keep]
            np.add((interference + 0.0)[:, None], p_harm[keep], out=harm_term[:, :k])
            harm_term[:, :k] *= w.interference
            harm_term[:, :k] /= slo_p
            stall_miss[:, :k] = p_miss[keep]
            np.logical_and(d_ok[:, None], p_ok[keep], out=feasible[:, :k])
            if hybrid:  # a hybrid worker does not prefill remotely for itself
                _exclude_self(feasible, prefill, decode, keep)
            p_cached[:, :k] = p.cached[keep]
            np.add(d.load[:, None], p.load[keep], out=load[:, :k])
        if local:  # D prefills itself: TTFT = its queue + compute, which stalls its decodes
            l_uncached = uncached[n_p:]
            l_compute = prefill_seconds(cost, l_uncached, local=True)
            l_wait = queue_seconds(cost, d.queued_tokens, d.queued_requests, local=True)
            if limits.peer_pull and request.bytes_per_block:  # + the pull, where it pays
                l_pull, l_uncached, l_compute = _pulls(
                    request, d.cached, l_uncached, l_compute, cost
                )
                l_wait = l_wait + l_pull
            l_stall = stall_seconds(cost, l_uncached)
            stalled = np.where(l_stall != 0, before + w.stall_newcomers, 0.0)
            harm = interference + stalled * l_stall / amortize
            ttft[:, k] = l_wait + l_compute
            compute[:, k] = w.compute * l_compute / slo_t
            harm_term[:, k] = w.interference * harm / slo_p
            stalled_tpot_n = (tpot + l_stall / amortize) / slo_p
            stall_miss[:, k] = np.minimum(
                w.stall_miss_cap, stalled * np.maximum(0.0, stalled_tpot_n - 1)
            )
            steps = [cost.step_seconds(load.worker_id) for load in decode]
            measured = np.array([s is not None for s in steps]) & (d.hybrid == 0)
            if measured.any():  # hybrid: every option stalls someone (`objective`)
                step_s = np.array([s or 0.0 for s in steps])
                certain = certain_stall_misses(
                    stalled, step_s, l_stall, request.max_tokens, slo_p, w
                )
                stall_miss[:, k] = np.where(
                    measured, np.maximum(stall_miss[:, k], certain), stall_miss[:, k]
                )
            feasible[:, k] = d_ok & queue_ok[n_p:]
            p_cached[:, k] = d.cached
            load[:, k] = d.load
        feasible_ttft = ttft[feasible]
        best_ttft = float(feasible_ttft.min()) if feasible_ttft.size else math.inf

        # Per decode worker: TPOT, its SLO overshoot, KV pressure.
        tpot_n = tpot / slo_p
        tpot_term, tpot_over = (w.tpot * tpot_n)[:, None], np.maximum(0.0, tpot_n - 1)[:, None]
        generated = request.output_blocks
        size = np.maximum(d.num_blocks, 1)  # 0 = unknown size: no term (masked below)
        by_rate = d.evictable * (d.hits / np.maximum(d.queries, 1))  # WorkerLoad.reused_blocks
        unheld = np.maximum(0, d.recent - (d.num_blocks - d.free) - d.inflight_blocks)
        reused = np.maximum(by_rate, np.minimum(d.evictable, unheld))
        held = (d.num_blocks - d.free + d.inflight_blocks + reused) / size
        over = np.maximum(0.0, held + (missing + generated) / size - w.kv_soft_limit)
        over -= np.maximum(0.0, held - w.kv_soft_limit)  # what this request adds
        kv = w.kv_pressure * over / (1 - w.kv_soft_limit)
        kv = np.where(d.num_blocks > 0, kv, 0.0)[:, None]
        # A miss even the best option makes is unavoidable: charged to no option (`objective`).
        avoidable = best_ttft <= slo_t
        # The terms in `objective`'s order; the TTFT penalty starts w.ttft_margin below the SLO.
        ttft_n = ttft / slo_t
        ttft_miss = np.maximum(0.0, ttft_n - (1 - w.ttft_margin)) if avoidable else 0.0
        total_ = ttft_n + tpot_term + compute + harm_term
        objective = total_ + w.slo_penalty * (ttft_miss + tpot_over + stall_miss) + kv
        return cls(
            objective=objective,
            feasible=feasible,
            prefill_cached=p_cached,
            decode_cached=d.cached,
            load=load,
            best_ttft_s=best_ttft,
            prefill_positions=keep,
        )

    def cost_ties(self, tolerance: float, kind_tolerance: float) -> np.ndarray:
        """Flat indices, in enumeration order, of the feasible options the cost policy ties
        on: objective within `tolerance` of the best (`kind_tolerance` for an option of the
        other kind, remote or local, than the first best), then the longest prefix on the
        prefilling worker, then on the decode worker (RoutingPolicy._tie_key). Not the least
        load: every router replica reads the same polled loads, so that key sent them all to
        the same worker."""
        objective = np.where(self.feasible, self.objective, math.inf).ravel()
        at_best = int(objective.argmin())
        best = float(objective[at_best])
        columns = self.objective.shape[1]
        remote = np.arange(objective.size) % columns < len(self.prefill_positions)
        within = np.where(remote == remote[at_best], tolerance, kind_tolerance)
        ties = np.flatnonzero(objective <= best + within)
        for key_of in (
            lambda at: -self.prefill_cached.ravel()[at],
            lambda at: -self.decode_cached[at // columns],
        ):
            if len(ties) == 1:  # a key cannot split one option
                break
            key = key_of(ties)
            ties = ties[key == key.min()]
        return ties

    def workers(self, flat_index: int) -> tuple[int | None, int]:
        """(prefill worker's position or None for local, decode worker's position)."""
        row, column = divmod(int(flat_index), self.objective.shape[1])
        remote = column < len(self.prefill_positions)
        return (int(self.prefill_positions[column]) if remote else None), row


def _hybrid_stalls(
    cost: CostModel, p: WorkerVectors, uncached: np.ndarray, amortize: int, limits: Limits
) -> tuple[np.ndarray, np.ndarray]:
    """Per prefill worker, what a remote prefill there does to its own decodes when it is
    hybrid (0 elsewhere), as `objective` prices it: the interference term's harm and the
    SLO overshoot of their TPOT with the stall, once per stalled request up to the cap."""
    stall = stall_seconds(cost, uncached)
    before = p.running + p.queued_requests
    stalls = (p.hybrid != 0) & (stall != 0)
    tpot_n = (line(cost.decode, np.maximum(1, before)) + stall / amortize) / limits.tpot_slo_s
    stalled = np.where(stalls, before + limits.weights.stall_newcomers, 0.0)
    cap = limits.weights.stall_miss_cap
    harm = stalled * stall / amortize
    return harm, np.minimum(cap, stalled * np.maximum(0.0, tpot_n - 1))


def _exclude_self(
    feasible: np.ndarray,
    prefill: Sequence[WorkerLoad],
    decode: Sequence[WorkerLoad],
    keep: np.ndarray,
) -> None:
    """Marks infeasible each remote option whose prefill worker is its decode worker."""
    rows = decode.position if isinstance(decode, LoadRows) else {
        w.worker_id: i for i, w in enumerate(decode)
    }  # fmt: skip
    for column, at in enumerate(keep):
        row = rows.get(prefill[at].worker_id)
        if row is not None:
            feasible[row, column] = False


def _undominated(
    ttft: np.ndarray, compute: np.ndarray, ok: np.ndarray, cached: np.ndarray
) -> np.ndarray:
    """Mask of the prefill workers no other one dominates. P dominates Q when, paired with any
    D, P is no worse on every input of the objective (its TTFT part, its compute term), is
    admitted whenever Q is, and wins the cost policy's tie key (a longer cached prefix: with an
    equal one Q may be within the tolerance and tie). Every rounded operation of the objective
    is monotone, so (P, D) costs at most what (Q, D) does: Q is never the best, never changes the best TTFT, and never
    survives the tie key, so dropping it changes no pick. The relation is transitive and
    irreflexive, so every dropped worker has an undominated dominator that stays."""
    better_key = cached[:, None] > cached[None, :]
    dominates = (
        (ttft[:, None] <= ttft[None, :])
        & (compute[:, None] <= compute[None, :])
        & (ok[:, None] >= ok[None, :])
        & better_key
    )  # [i, j]: i dominates j
    return ~dominates.any(axis=0)


def _pulls(
    request: RoutingRequest,
    own: np.ndarray,
    uncached: np.ndarray,
    compute: np.ndarray,
    cost: CostModel,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each decode worker's local prefill with the pull router/estimates.py's `estimate`
    prices: the pull's seconds (0 where it does not pay), the tokens left to compute and
    their compute. `own`: the blocks each holds; the peer is the longest other holder."""
    limit = (request.prompt_tokens - 1) // request.block_size
    peer = np.minimum(max_of_others(own), limit)
    pull_s = cost.handoff_seconds() + line(cost.transfer, (peer - own) * request.bytes_per_block)
    pulled_uncached = uncached_tokens(request, peer)
    pulled_compute = prefill_seconds(cost, pulled_uncached, local=True)
    pays = (peer > own) & (pull_s < PULL_MARGIN * (compute - pulled_compute))
    return (
        np.where(pays, pull_s, 0.0),
        np.where(pays, pulled_uncached, uncached),
        np.where(pays, pulled_compute, compute),
    )


def _queue_ok(workers: WorkerVectors, uncached: np.ndarray, limits: Limits) -> np.ndarray:
    """Prefill-side admission (RoutingPolicy._admission): the prompt queue stays bounded.
    `uncached`: the tokens each worker would compute (`uncached_tokens`)."""
    queued = workers.queued_tokens
    return (queued == 0) | (queued + uncached <= limits.max_queued_prefill_tokens)
