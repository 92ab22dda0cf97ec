"""One rate probe: a sample of the workload offered to one split at one request rate, on the
virtual clock, and whether at least `attainment` of its requests met both SLOs.

Goodput is counted as `pdserve bench` counts it (`bench.metrics.meets_slo`: TTFT and TPOT
within the targets, a refused request never). A probe stops as soon as its verdict is certain:
when more requests have missed than the attainment allows (a request that has no first token
by its TTFT target, or is still decoding when even its remaining tokens cannot bring its TPOT
within target, has missed), or when enough have met both targets.
"""

from __future__ import annotations

import gc
import math
import statistics
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from pdserve.config import RouterConfig
from pdserve.planner.cluster import RouterTiming, VirtualCluster
from pdserve.planner.deployment import Deployment
from pdserve.planner.virtual_request import VirtualRequest
from pdserve.planner.workload import ProbeRequest
from pdserve.workloads.metrics import LatencyStats, meets_slo

_LATE = 1e-9  # a miss is certain just after its deadline (meeting it exactly counts)
# A probe allocates millions of objects that reference counting frees at once (outputs, step
# chunks, lists); the cyclic collector's default pass every 700 allocations scans the
# survivors over and over: ~6% of a 16-worker probe's CPU (0.5-0.67 s of ~8 s for 9P:7D,
# 3000 requests, measured with gc.callbacks), 0.08-0.17 s with a pass every 10k-200k. Its
# cycles (a finished probe's cluster) are still collected, only in fewer, larger passes.
YOUNG_COLLECTION_ALLOCATIONS = 100_000


@dataclass(frozen=True)
class SLO:
    ttft_ms: float
    tpot_ms: float
    attainment: float = 0.9  # fraction of requests that must meet both targets


@dataclass(frozen=True)
class Split:
    """Prefill and decode workers; prefill = 0 is colocated serving (its workers at
    decode_tp), or with `hybrid` workers that each prefill and decode, and may prefill for
    one another (`--hybrid`). Each pool's workers are tensor-parallel groups of its TP's GPUs."""

    prefill: int
    decode: int
    prefill_tp: int = 1
    decode_tp: int = 1
    hybrid: bool = False

    @property
    def gpus(self) -> int:
        return self.prefill * self.prefill_tp + self.decode * self.decode_tp

    @property
    def name(self) -> str:
        if self.prefill == 0:
            tp = f" (TP {self.decode_tp})" if self.decode_tp > 1 else ""
            return f"{'hybrid' if self.hybrid else 'colocated'} {self.decode}{tp}"
        tp = (
            f" (TP {self.prefill_tp}:{self.decode_tp})"
            if self.gpus > self.prefill + self.decode
            else ""
        )
        return f"{self.prefill}P:{self.decode}D{tp}"

    def replica(self, k: int) -> Split:
        """One of k identical replicas of this split."""
        return Split(
            self.prefill // k, self.decode // k, self.prefill_tp, self.decode_tp, self.hybrid
        )


@dataclass
class ProbeResult:
    split: Split
    rate: float  # requests/s offered
    requests: int
    good: int
    missed: int
    passed: bool
    complete: bool  # every request ended (not stopped at a certain verdict)
    elapsed_s: float  # simulated
    ttft: LatencyStats  # of the requests that completed, in ms
    tpot: LatencyStats
    prefill_utilisation: float
    decode_utilisation: float
    # The most sequences one worker ran at once, as a share of max_num_seqs: near 1 a worker's
    # batch fills up and requests queue behind it, a queue that a short probe ends before it
    # builds (Search._probe judges such a pass again on a longer probe).
    peak_batch: float = 0.0
    # Requests prefilled on another worker than their decode worker, of those routed: how
    # far `auto` disaggregated (0 colocated, 1 a split under `always`).
    remote_share: float = 0.0
    # The median TTFT of the last quarter of the arrivals over that of the second quarter
    # (`ttft_growth`): near 1 while queues hold steady, well above it while one builds through
    # the probe, which a longer probe would carry past the SLO (Search._probe).
    ttft_growth: float = 1.0


class _Verdict:
    """Counts requests that met both targets and ones that missed, each once."""

    def __init__(self, cluster: VirtualCluster, slo: SLO, total: int) -> None:
        self.cluster, self.slo = cluster, slo
        # No step that samples a token is shorter (the timing model's bound; 0 without one),
        # and a sequence gets at most one token a step (the sim engine does not speculate).
        self.token_step_s = max(0.0, cluster.min_sampling_step_seconds())
        self.needed = math.ceil(slo.attainment * total - 1e-9)
        self.allowed_misses = total - self.needed
        self.good = self.missed = self.finished = 0
        self._judged: set[int] = set()

    @property
    def certain(self) -> bool:
        return self.missed > self.allowed_misses or self.good >= self.needed

    def arrived(self, request: VirtualRequest) -> None:
        deadline = self.slo.ttft_ms / 1e3 * (1 + _LATE) + _LATE
        self.cluster.loop.after(deadline, lambda: self._check_first_token(request))

    def first_token(self, request: VirtualRequest) -> None:
        remaining = request.probe.output_len - 1
        if remaining > 0:
            now = self.cluster.loop.now
            deadline = now + (self.slo.tpot_ms / 1e3 * remaining * (1 + _LATE) + _LATE)
            # Checked as an event of its own, never in this call (made from the first token's
            # delivery). Tokens a decode worker made before the router streamed it come in one
            # burst (VirtualRequest._held), but each was made by a step of its own after now.
            first_check = deadline - (remaining - 1) * self.token_step_s
            self.cluster.loop.at(first_check, lambda: self._check_done(request, deadline))

    def ended(self, request: VirtualRequest) -> None:
        self.finished += 1
        if meets_slo(request.record, self.slo.ttft_ms, self.slo.tpot_ms):
            self._judge(request, good=True)
        else:
            self._judge(request, good=False)

    def _check_first_token(self, request: VirtualRequest) -> None:
        if not request.record.chunk_times:
            self._judge(request, good=False)

    def _check_done(self, request: VirtualRequest, deadline: float) -> None:
        """A request still decoding has missed its TPOT target once its last token cannot come
        before `deadline` (the target's, just past it). After its first token every token
        reaches the client at the end of the decode step that made them; its remaining tokens
        each need a step of their own, one after the other, and no step is shorter than
        `token_step_s`, so the last comes at least (remaining - 1) such steps from now (the
        first of them may end a step already running). Checked again when that no longer
        leaves time; with no bound (0), once, at the deadline."""
        if request.ended:
            return
        remaining = request.probe.output_len - request.record.output_tokens
        last_chance = deadline - max(0, remaining - 1) * self.token_step_s
        if last_chance <= self.cluster.loop.now:
            self._judge(request, good=False)
        else:
            self.cluster.loop.at(last_chance, lambda: self._check_done(request, deadline))

    def _judge(self, request: VirtualRequest, good: bool) -> None:
        if request.probe.index in self._judged:
            return
        self._judged.add(request.probe.index)
        if good:
            self.good += 1
        else:
            self.missed += 1


def _remote_share(runs: list[VirtualRequest]) -> float:
    routed = [run.route for run in runs if run.route is not None]
    return sum(1 for r in routed if r.prefill_worker) / len(routed) if routed else 0.0


@contextmanager
def young_collections_every(allocations: int) -> Iterator[None]:
    """The cyclic collector's youngest generation collected every `allocations` net
    allocations instead of its default, restored on exit."""
    threshold = gc.get_threshold()
    gc.set_threshold(max(allocations, threshold[0]), *threshold[1:])
    try:
        yield
    finally:
        gc.set_threshold(*threshold)


def run_probe(
    deployment: Deployment,
    split: Split,
    requests: list[ProbeRequest],
    rate: float,
    slo: SLO,
    router_config: RouterConfig,
    timing: RouterTiming = RouterTiming(),
    stop_when_certain: bool = True,
    keep_tokens: bool = False,
    index_lag_s: float | None = None,
    router_replicas: int = 1,
    attach: Callable[[VirtualCluster], Callable[[ProbeRequest], None]] | None = None,
) -> tuple[ProbeResult, list[VirtualRequest]]:
    """Offers `requests` at `rate` requests/s (arrival k at unit_arrival / rate);
    `index_lag_s`, `router_replicas`: VirtualCluster's (the router's copy of the index, None:
    none; routers side by side). `attach` is called with the cluster once made; what it
    returns hears each request as it arrives (role switching's planner:
    pdserve/planner/role_switching.py)."""
    # The cluster and the requests too are made with fewer collections: each request brings
    # several containers, and making 8000 took 104 passes, 0.03-0.08 s (of 0.08-0.12 s).
    with young_collections_every(YOUNG_COLLECTION_ALLOCATIONS):
        cluster = VirtualCluster(
            deployment, split.prefill, split.decode, router_config, timing, keep_tokens,
            index_lag_s, router_replicas, hybrid=split.hybrid,
        )  # fmt: skip
        verdict = _Verdict(cluster, slo, len(requests))
        runs = [VirtualRequest(cluster, r, verdict) for r in requests]
        heard = attach(cluster) if attach is not None else None

        def arrive(run: VirtualRequest) -> None:
            verdict.arrived(run)
            if heard is not None:
                heard(run.probe)
            run.start()

        start = min(r.unit_arrival for r in requests) / rate
        for run in runs:
            cluster.loop.at(run.probe.unit_arrival / rate, lambda run=run: arrive(run))
        total = len(runs)
        if stop_when_certain:
            cluster.loop.run(lambda: verdict.finished == total or verdict.certain)
        else:
            cluster.loop.run(lambda: verdict.finished == total)
    elapsed = cluster.loop.now - start
    done = [r.record for r in runs if r.record.ok]
    result = ProbeResult(
        split=split,
        rate=rate,
        requests=total,
        good=verdict.good,
        missed=verdict.missed,
        passed=verdict.good >= verdict.needed,
        complete=verdict.finished == total,
        elapsed_s=elapsed,
        ttft=LatencyStats.of([r.ttft for r in done]),
        tpot=LatencyStats.of([r.tpot for r in done if r.tpot is not None]),
        prefill_utilisation=cluster.utilisation("prefill", elapsed),
        decode_utilisation=cluster.utilisation("decode", elapsed),
        peak_batch=cluster.peak_running() / deployment.engine_config.max_num_seqs,
        remote_share=_remote_share(runs),
        ttft_growth=ttft_growth(runs, rate, cluster.loop.now),
    )
    return result, runs


def ttft_growth(runs: list[VirtualRequest], rate: float, now: float) -> float:
    """Median TTFT of the requests that arrived in the last quarter of the probe's arrivals over
    that of the second quarter (the first fills an empty cluster); a request still without its
    first token at `now` counts the time it has waited. 1.0 with fewer than 8 arrivals."""
    arrived = sorted(
        (
            (r.probe.unit_arrival / rate, r.record.ttft)
            for r in runs
            if r.probe.unit_arrival / rate <= now
        ),
        key=lambda sent_ttft: sent_ttft[0],  # a trace's equal arrivals: no None to compare
    )
    n = len(arrived)
    if n < 8:
        return 1.0

    def waited(quarter: list[tuple[float, float | None]]) -> float:
        return statistics.median(now - sent if ttft is None else ttft for sent, ttft in quarter)

    second = waited(arrived[n // 4 : n // 2])
    return waited(arrived[3 * n // 4 :]) / second if second > 0 else 1.0
