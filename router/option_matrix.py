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
rotation) is the policy's own. tests/router/test_option_matrix.py checks it against the
enumeration on random loads and caches. Only the chosen option becomes an Estimate; the
estimate of every option (for tracing and tests) is built on first access.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from router.cost_model import CostModel, LinearFit
from router.estimates import Estimate, RoutingRequest, Weights, WorkerLoad


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


@dataclass(frozen=True)
class Limits:
    """The policy's settings that enter an option's objective and admission."""

    ttft_slo_s: float
    tpot_slo_s: float
    max_queued_prefill_tokens: int
    weights: Weights


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
        prune: bool = True,
    ) -> OptionMatrix:
        """`prune`: drop the columns of prefill workers that another one dominates (see
        `_undominated`): the cost policy's pick is the same, the matrix smaller."""
        w, full, total = limits.weights, request.full_blocks, request.total_blocks
        prefill = prefill if remote else []
        d = _Workers(decode, cached, full)
        p = _Workers(prefill, cached, full)
        tpot = _line(cost.decode, d.running + d.queued_requests + 1)
        # Decode-side admission: room for the blocks it lacks.
        d_ok = (d.num_blocks == 0) | (total - d.cached <= d.free)

        slo_t, slo_p = limits.ttft_slo_s, limits.tpot_slo_s
        before = d.running + d.queued_requests  # D's batch without this request
        slowdown = tpot - _line(cost.decode, np.maximum(1, before))
        interference = d.running * np.maximum(0.0, slowdown)  # to D's running requests
        # Remote columns: TTFT = (queue + compute on P) + transfer to D (see estimate); no stall.
        p_compute = _prefill_seconds(cost, _uncached(request, p.cached), local=False)
        p_ttft = _queue_seconds(cost, p.queued_tokens, p.queued_requests, local=False) + p_compute
        transfer = _line(cost.transfer, (total - d.cached) * request.bytes_per_block)
        p_compute_term = w.compute * p_compute / slo_t
        p_ok = _queue_ok(p, p.cached, request, limits)
        keep = np.arange(len(prefill))
        if prune:
            keep = keep[_undominated(p_ttft, p_compute_term, p_ok, p.cached, p.load)]
        blocks = [
            _Columns(
                ttft=p_ttft[keep][None, :] + transfer[:, None],
                compute=p_compute_term[keep][None, :],
                interference=(w.interference * (interference + 0.0) / slo_p)[:, None],
                feasible=d_ok[:, None] & p_ok[keep][None, :],
                prefill_cached=np.broadcast_to(p.cached[keep][None, :], (len(decode), len(keep))),
                load=d.load[:, None] + p.load[keep][None, :],
            )
        ]
        if local:  # D prefills itself: TTFT = its queue + compute, which stalls its decodes
            l_compute = _prefill_seconds(cost, _uncached(request, d.cached), local=True)
            l_wait = _queue_seconds(cost, d.queued_tokens, d.queued_requests, local=True)
            amortize = max(1, min(w.stall_amortize_tokens, request.max_tokens))
            stalled = np.where(l_compute != 0, before + w.stall_newcomers, 0.0)
            harm = interference + stalled * l_compute / amortize
            blocks.append(
                _Columns(
                    ttft=(l_wait + l_compute)[:, None],
                    compute=(w.compute * l_compute / slo_t)[:, None],
                    interference=(w.interference * harm / slo_p)[:, None],
                    feasible=(d_ok & _queue_ok(d, d.cached, request, limits))[:, None],
                    prefill_cached=d.cached[:, None],
                    load=d.load[:, None],
                )
            )
        feasible_ttft = [b.ttft[b.feasible] for b in blocks if b.feasible.any()]
        best_ttft = float(min(t.min() for t in feasible_ttft)) if feasible_ttft else math.inf

        # Per decode worker: TPOT, its SLO overshoot, KV pressure.
        tpot_n = tpot / slo_p
        tpot_term, tpot_over = (w.tpot * tpot_n)[:, None], np.maximum(0.0, tpot_n - 1)[:, None]
        generated = math.ceil(request.max_tokens / request.block_size)
        size = np.maximum(d.num_blocks, 1)  # 0 = unknown size: no term (masked below)
        used = d.num_blocks - d.free + (total - d.cached + generated)
        over = used / size - w.kv_soft_limit
        kv = w.kv_pressure * np.maximum(0.0, over) / (1 - w.kv_soft_limit)
        kv = np.where(d.num_blocks > 0, kv, 0.0)[:, None]
        # A miss even the best option makes is unavoidable: charged to no option (`objective`).
        avoidable = best_ttft <= slo_t
        objectives = []
        for b in blocks:  # the terms in `objective`'s order
            ttft_n = b.ttft / slo_t
            ttft_miss = np.maximum(0.0, ttft_n - 1) if avoidable else 0.0
            total_ = ttft_n + tpot_term + b.compute + b.interference
            objectives.append(total_ + w.slo_penalty * (ttft_miss + tpot_over) + kv)
        objective = np.hstack(objectives)
        feasible = np.hstack([b.feasible for b in blocks])
        p_cached = np.hstack([b.prefill_cached for b in blocks])
        load = np.hstack([b.load for b in blocks])
        return cls(
            objective=objective,
            feasible=feasible,
            prefill_cached=p_cached,
            decode_cached=d.cached,
            load=load,
            best_ttft_s=best_ttft,
            prefill_positions=keep,
        )

    def cost_ties(self, tolerance: float) -> np.ndarray:
        """Flat indices, in enumeration order, of the feasible options the cost policy ties
        on: objective within `tolerance` of the best, then the longest prefix on the prefilling
        worker, then on the decode worker, then the least load (RoutingPolicy._tie_key)."""
        objective = np.where(self.feasible, self.objective, math.inf).ravel()
        best = float(objective.min())
        ties = np.flatnonzero(objective <= best + tolerance)
        for keys in (
            -self.prefill_cached.ravel(),
            -np.repeat(self.decode_cached, self.objective.shape[1]),
            self.load.ravel(),
        ):
            key = keys[ties]
            ties = ties[key == key.min()]
        return ties

    def workers(self, flat_index: int) -> tuple[int | None, int]:
        """(prefill worker's position or None for local, decode worker's position)."""
        row, column = divmod(int(flat_index), self.objective.shape[1])
        remote = column < len(self.prefill_positions)
        return (int(self.prefill_positions[column]) if remote else None), row


def _undominated(
    ttft: np.ndarray, compute: np.ndarray, ok: np.ndarray, cached: np.ndarray, load: np.ndarray
) -> np.ndarray:
    """Mask of the prefill workers no other one dominates. P dominates Q when, paired with any
    D, P is no worse on every input of the objective (its TTFT part, its compute term), is
    admitted whenever Q is, and wins the cost policy's tie key (a longer cached prefix, or an
    equal one and less load). Every rounded operation of the objective is monotone, so (P, D)
    costs at most what (Q, D) does: Q is never the best, never changes the best TTFT, and never
    survives the tie key, so dropping it changes no pick. The relation is transitive and
    irreflexive, so every dropped worker has an undominated dominator that stays."""
    better_key = (cached[:, None] > cached[None, :]) | (
        (cached[:, None] == cached[None, :]) & (load[:, None] < load[None, :])
    )
    dominates = (
        (ttft[:, None] <= ttft[None, :])
        & (compute[:, None] <= compute[None, :])
        & (ok[:, None] >= ok[None, :])
        & better_key
    )  # [i, j]: i dominates j
    return ~dominates.any(axis=0)


@dataclass
class _Columns:
    """Options of one kind (remote pairs or local) as arrays broadcasting to D x columns."""

    ttft: np.ndarray
    compute: np.ndarray  # the objective's compute term
    interference: np.ndarray  # the objective's interference term
    feasible: np.ndarray
    prefill_cached: np.ndarray
    load: np.ndarray


class _Workers:
    """One pool's load snapshot as integer vectors."""

    def __init__(self, workers: Sequence[WorkerLoad], cached: dict[str, int], full: int) -> None:
        rows = [
            (cached.get(w.worker_id, 0), w.num_running, w.queued_requests, w.queued_tokens,
             w.num_blocks, w.num_free_blocks, w.load)
            for w in workers
        ]  # fmt: skip
        table = np.array(rows, dtype=np.int64).reshape(len(workers), 7).T
        self.cached = np.minimum(table[0], full)
        self.running, self.queued_requests, self.queued_tokens = table[1], table[2], table[3]
        self.num_blocks, self.free, self.load = table[4], table[5], table[6]


def _uncached(request: RoutingRequest, cached_blocks: np.ndarray) -> np.ndarray:
    """RoutingRequest.uncached_tokens over a vector of cached prefixes."""
    cached = np.minimum(cached_blocks, request.full_blocks) * request.block_size
    return np.maximum(1, request.prompt_tokens - cached)


def _queue_ok(
    workers: _Workers, cached: np.ndarray, request: RoutingRequest, limits: Limits
) -> np.ndarray:
    """Prefill-side admission (RoutingPolicy._admission): the prompt queue stays bounded."""
    queued = workers.queued_tokens
    new = _uncached(request, cached)
    return (queued == 0) | (queued + new <= limits.max_queued_prefill_tokens)


def _line(fit: LinearFit, x: np.ndarray) -> np.ndarray:
    """LinearFit.predict over a vector."""
    a, b = fit.coefficients
    return a + b * np.maximum(0.0, x)


def _prefill_seconds(cost: CostModel, tokens: np.ndarray, *, local: bool) -> np.ndarray:
    """CostModel.prefill_seconds over a vector."""
    return np.maximum.reduce([_line(fit, tokens) for fit in cost.prefill_fits(local)])


def _queue_seconds(
    cost: CostModel, tokens: np.ndarray, requests: np.ndarray, *, local: bool
) -> np.ndarray:
    """CostModel.prefill_queue_seconds over vectors."""
    steps = np.minimum(requests, tokens // max(1, cost.step_tokens))
    waits = []
    for fit in cost.prefill_fits(local):
        a, b = fit.coefficients
        waits.append(a * steps + b * tokens)
    return np.maximum.reduce(waits)
