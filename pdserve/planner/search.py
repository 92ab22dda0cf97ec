"""The search: goodput of every split of the GPUs, by bisection over the request rate.

Goodput (DistServe's) is the highest rate at which at least `slo.attainment` of the requests
meet both SLOs. Each split's search starts from its estimate (capacity.py's `split_estimate`:
throughput bounds from the timing model, scaled by how far the goodputs already found for the
nearest splits of its kind lay from theirs) and walks up while probes pass, or down until one passes
(a failing probe is cheap: it stops as soon as the misses exceed what the attainment allows),
by steps of 1.2x, 1.2x, then squaring, then bisects geometrically until the bracket is within
`precision`.

Splits are searched in waves, cheapest to simulate first: a wave is every split whose probes
simulate the same number of workers (see Replicas). From the second wave on the bar is the
lowest of the `top` best goodputs found (of all found, while fewer than `top`): a split is
first probed at its start when that lies well above the bar (one pass there tells as much as
a pass at the bar), else at the bar, and dropped (`pruned`) when it fails at the bar: it
cannot be among the best. The cheap splits so raise the bar before the splits that simulate
every worker are probed, and most of those fail at it, fast (an overloaded probe stops
early). A pass that used nearly all the misses the attainment allows (`NEAR_EDGE`) lies just
below the knee, where the verdict flips within a few percent of rate: the next probe then
goes up by the precision alone. Unless `rank_all`, a disaggregated split that passed the bar
is next probed at the best goodput of the earlier waves, and stops once it fails at or below
it (`below_best`: it cannot be the recommendation; its goodput is only bracketed).

The splits of a wave are independent of one another (its bar is fixed when it starts), so
`jobs` processes (started once, each given the search once) search them in parallel,
the likeliest to be searched in full first; the plan is the same for any `jobs`, as each
split's probes depend only on its own results, its start and its wave's bar.

Replicas: a split whose worker counts share a factor k is simulated as one of its k identical
replicas (P/k prefill and D/k decode workers) at 1/k of the rate, as DistServe replicates a
placement: the router spreads load evenly over identical workers, and a probe of a smaller
cluster needs proportionally fewer requests to reach the same load. Every simulated replica
keeps at least `min_replica_workers` workers, so the router still chooses among several.
A probe offers `requests_per_worker` requests per simulated worker (at most the sample). A
pass in which some worker's batch came near max_num_seqs (`STEADY_TRIGGER`), or whose last
arrivals waited much longer for their first token than earlier ones (`STEADY_GROWTH`: a queue
building), is judged again on `steady_requests_per_worker` requests per worker, and so is the
goodput a split's short probes bracketed (`Search._confirm`): near a full batch, requests queue
behind it and lengthen the batch's steps, which lengthens their lives and fills the batch
further, over many request lifetimes; a shorter probe ends before that builds. Measured on 8
H100s, chat, colocated, as replicas of 2 workers (the most sequences one worker ran, and the
share that met the SLOs): at 600 req/s 205 and 100% with 500 requests per worker, 256 and 100%
with 2048; at 630 req/s 233 and 100% with 500, 256 and 57% with 2048.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import dataclass, field

from pdserve.config import RouterConfig
from pdserve.planner.capacity import WorkerRates, split_estimate, worker_rates
from pdserve.planner.cluster import RouterTiming
from pdserve.planner.deployment import Deployment
from pdserve.planner.probe import SLO, ProbeResult, Split, run_probe
from pdserve.planner.search_pool import search_in_worker, worker_pool
from pdserve.planner.splits import replica_count, simulated_workers
from pdserve.planner.workload import ProbeRequest

MIN_RATE = 1e-3  # requests/s: below this a split serves nothing within the SLOs
# A split still passing at this multiple of its estimate absorbs the whole sample as one
# burst: its goodput is reported as at least that rate (`saturated`), more requests per probe
# would tell more.
MAX_OVER_ESTIMATE = 16
# The bracket's first step from the start rate (see Search._search): 1.2 is bisected within 5%
# in two probes.
FIRST_STEP = 1.2
# A pass whose busiest worker ran this share of max_num_seqs at once is judged again on a probe
# of STEADY_REQUESTS_PER_SEQ x max_num_seqs requests per worker (the module docstring): at the
# knee a worker runs ~max_num_seqs requests, so that probe's arrivals span ~8 of their lives.
STEADY_TRIGGER = 0.75
STEADY_REQUESTS_PER_SEQ = 8
# A pass whose last arrivals waited this many times as long for their first token as its
# second quarter's (ProbeResult.ttft_growth) is judged again on the longer probe too: a queue
# that builds before any batch fills (a prefill worker's, say) carries a longer probe past the
# TTFT SLO. 70B agentic, `auto` on 1P:3D (2026-11-29): 600-request probes passed at 125 and 142
# req/s with growth 2.0 and 3.5, 8192-request probes failed from 96; below the knee chat and rag
# read 0.89-1.11 (docs/benchmarks/simulation.md, session 10).
STEADY_GROWTH = 1.5
# The fewest workers a simulated replica keeps by default (the module docstring, "Replicas").
MIN_REPLICA_WORKERS = 2
# A passing probe that used this share of the misses it was allowed is taken to lie just below
# the knee (Search._near_edge): the next probe goes up by the precision alone.
NEAR_EDGE = 0.85


@dataclass
class SplitResult:
    split: Split
    estimate: float  # requests/s the timing model's throughput bounds allow
    replicas: int = 1  # the split is simulated as one of this many identical replicas
    goodput: float = 0.0  # highest rate that passed (0: none did)
    failed_at: float | None = None  # lowest rate that failed
    best: ProbeResult | None = None  # the probe at `goodput`
    probes: list[ProbeResult] = field(default_factory=list)
    pruned: bool = False  # failed at the bar (the best splits' lowest goodput): not searched
    saturated: bool = False  # passed even at MAX_OVER_ESTIMATE x the estimate
    # Disaggregated, passed the bar and failed at or below the best goodput of an earlier
    # wave: its goodput is known only to lie in [goodput, failed_at) (see Search.rank_all).
    below_best: bool = False
    # A pass came near a full batch: probed since on steady_requests_per_worker requests.
    steady: bool = False
    # The step token budget it was searched at, when `pdserve plan` searched several
    # (--max-num-batched-tokens 256,8192) and kept each split at its best.
    max_num_batched_tokens: int | None = None


@dataclass
class Plan:
    results: list[SplitResult]  # best first
    precision: float
    seconds: float  # wall time of the search
    probes: int

    @property
    def best(self) -> SplitResult:
        return self.results[0]

    @property
    def recommended(self) -> SplitResult:
        """The best split, or colocated when disaggregating gains no more than the precision."""
        colocated = next(
            (r for r in self.results if r.split.prefill == 0 and not r.split.hybrid), None
        )
        best = self.best
        if colocated is not None and best.goodput <= colocated.goodput * (1 + self.precision):
            return colocated
        return best


def ranked(results: list[SplitResult]) -> list[SplitResult]:
    """Best goodput first; at equal goodputs the one that failed higher first (a bracketed
    split below the best may lie anywhere up to its failure)."""
    return sorted(
        results, key=lambda r: (-r.goodput, r.pruned, -(r.failed_at or math.inf), r.split.prefill)
    )


def steady_requests_per_worker(deployment: Deployment) -> int:
    """Requests per worker of a probe that judges again a pass near a full batch."""
    return STEADY_REQUESTS_PER_SEQ * deployment.engine_config.max_num_seqs


def sampled_requests_per_worker(deployment: Deployment, requests_per_worker: int) -> int:
    """Requests per worker a Search's sample must hold: its probes', and room for the longer
    ones that judge again a pass near a full batch (`Search._probe`)."""
    return max(requests_per_worker, steady_requests_per_worker(deployment))


class Search:
    def __init__(
        self,
        deployment: Deployment,
        sample: list[ProbeRequest],
        slo: SLO,
        router_config: RouterConfig,
        timing: RouterTiming = RouterTiming(),
        precision: float = 0.05,
        top: int = 3,
        requests_per_worker: int = 500,
        min_replica_workers: int = MIN_REPLICA_WORKERS,
        on_probe: Callable[[ProbeResult], None] | None = None,
        jobs: int = 1,
        rank_all: bool = True,
        deployment_for: Callable[[Split], Deployment] | None = None,
        index_lag_s: float | None = None,
    ) -> None:
        """`jobs` > 1: splits are searched in that many worker processes (`on_probe` is then
        called in them; it and `deployment_for` are pickled, so module-level, not closures).
        `rank_all`: every split that passes the bar is searched within the precision; otherwise
        a disaggregated one stops once it failed at or below the best goodput of an earlier
        wave (it cannot be the recommendation: `below_best`).
        `deployment_for`: the deployment of a split whose pools run at other TPs (tp_splits);
        default `deployment` for every split. `index_lag_s`: probes give the router a copy of
        the prefix index, fed by the workers' KV events this long after each step (None: no
        index, as `pdserve plan` runs; VirtualCluster)."""
        self.deployment, self.sample, self.slo = deployment, sample, slo
        self._deployment_for = deployment_for
        self.router_config, self.timing = router_config, timing
        self.precision, self.top = precision, top
        self.requests_per_worker = requests_per_worker
        self.min_replica_workers = min_replica_workers
        self.on_probe = on_probe
        self.jobs = jobs
        self.rank_all = rank_all
        self.index_lag_s = index_lag_s
        self.probes = 0

    def deployment_for(self, split: Split) -> Deployment:
        if self._deployment_for is None:
            return self.deployment
        return self._deployment_for(split)

    def run(self, splits: list[Split]) -> Plan:
        started = time.perf_counter()
        rates: dict[tuple[int, int], WorkerRates] = {}  # by the pools' TPs
        for s in splits:
            tps = (s.prefill_tp, s.decode_tp)
            if tps not in rates:
                rates[tps] = worker_rates(self.deployment_for(s), self.sample)
        disaggregate = self.router_config.disaggregate
        results = [
            SplitResult(
                s,
                split_estimate(rates[s.prefill_tp, s.decode_tp], s, disaggregate),
                replica_count(s, self.min_replica_workers),
            )
            for s in splits
        ]
        pending, searched = list(results), []
        with self._workers(len(results)) as pool:
            while pending:
                cost = min(simulated_workers(r.split, r.replicas) for r in pending)
                wave = [r for r in pending if simulated_workers(r.split, r.replicas) == cost]
                pending = [r for r in pending if all(r is not w for w in wave)]
                starts = {id(r): r.estimate * _calibration(searched, r.split) for r in wave}
                # The likeliest to be searched in full first: the longest jobs start first.
                wave.sort(key=lambda r: (-starts[id(r)], r.split.prefill))
                bar = _bar(searched, self.top)
                best = 0.0 if self.rank_all else max((r.goodput for r in searched), default=0.0)
                self._search_wave(pool, wave, bar, best, [starts[id(r)] for r in wave])
                searched += wave
        self.probes = sum(len(r.probes) for r in results)
        return Plan(ranked(results), self.precision, time.perf_counter() - started, self.probes)

    def _workers(self, splits: int) -> AbstractContextManager[ProcessPoolExecutor | None]:
        """`jobs` worker processes for the waves (None: search here); search_pool.py."""
        return worker_pool(self, min(self.jobs, splits))

    def _search_wave(
        self,
        pool: ProcessPoolExecutor | None,
        wave: list[SplitResult],
        bar: float,
        best: float,
        starts: list[float],
    ) -> None:
        """Searches each split of `wave` in place (see `_search`), in the pool if any."""
        if pool is None or len(wave) == 1:
            for result, start in zip(wave, starts, strict=True):
                self._search(result, bar, best, start)
            return
        searched = pool.map(search_in_worker, wave, [bar] * len(wave), [best] * len(wave), starts)
        for result, done in zip(wave, searched, strict=True):
            result.__dict__.update(done.__dict__)

    def _sizes(self, result: SplitResult) -> tuple[int, int]:
        """(short, steady): the requests of the split's probes, before and once `steady`."""
        replica = result.split.replica(result.replicas)
        workers = replica.prefill + replica.decode
        steady = min(len(self.sample), steady_requests_per_worker(self.deployment) * workers)
        return self.requests_per_worker * workers, steady

    def _probe(self, result: SplitResult, rate: float) -> bool:
        replica = result.split.replica(result.replicas)
        short, steady = self._sizes(result)
        size = steady if result.steady else short
        probe = self._run(result, replica, size, rate)
        building = probe.peak_batch >= STEADY_TRIGGER or probe.ttft_growth >= STEADY_GROWTH
        if probe.passed and building and steady > size:
            # Judged again, and every later probe of the split as long (the module docstring):
            # the verdicts that bracket its goodput then come from probes of one length.
            result.steady = True
            probe = self._run(result, replica, steady, rate)
        if probe.passed:
            if rate > result.goodput:
                result.goodput, result.best = rate, probe
        elif result.failed_at is None or rate < result.failed_at:
            result.failed_at = rate
        return probe.passed

    def steady_probe(self, split: Split, rate: float, to_end: bool = True) -> ProbeResult:
        """The split's steady probe at `rate`, sized and replicated as the search confirms a
        goodput with; `to_end`: run until every request ends rather than to a certain verdict
        (equal rates for families side by side: bench sim-disagg --suite --at-rates)."""
        result = SplitResult(split, 0.0, replica_count(split, self.min_replica_workers))
        _, steady = self._sizes(result)
        return self._run(result, split.replica(result.replicas), steady, rate, to_end=to_end)

    def _run(
        self, result: SplitResult, replica: Split, size: int, rate: float, to_end: bool = False
    ) -> ProbeResult:
        """One probe of `size` requests of the sample on one replica of the split (`to_end`:
        not stopped once its verdict is certain)."""
        k = result.replicas
        probe, _ = run_probe(
            self.deployment_for(result.split),
            replica,
            self.sample[:size],
            rate / k,
            self.slo,
            self.router_config,
            self.timing,
            stop_when_certain=not to_end,
            index_lag_s=self.index_lag_s,
        )
        probe.split, probe.rate = result.split, rate
        self.probes += 1
        result.probes.append(probe)
        if self.on_probe is not None:
            self.on_probe(probe)
        return probe

    def _search(self, result: SplitResult, bar: float, best: float, start: float) -> None:
        """Brackets the split's goodput (`_bracket`), then confirms it on the steady probe."""
        self._bracket(result, bar, best, start)
        self._confirm(result, best)

    def _bracket(self, result: SplitResult, bar: float, best: float, start: float) -> None:
        """With a bar (> 0): probes at `start` first when it lies well above the bar (a pass
        there is a pass at the bar), then at the bar, and prunes the split if it fails there.
        Then brackets the goodput from `start` (or just above the highest rate that passed)
        and bisects. With a best goodput (> 0) a disaggregated split that passed is next
        probed at the best, and stops (`below_best`) once it failed at or below it."""
        rate = max(start, MIN_RATE)
        if bar > 0:
            if rate >= bar * FIRST_STEP:
                self._probe(result, rate)
            if result.goodput == 0.0 and not self._probe(result, bar):
                result.pruned = True
                return
        ceiling = max(rate, result.estimate * MAX_OVER_ESTIMATE)
        # A pass that used nearly all the misses the attainment allows lies just below the
        # knee (the verdict flips over a few percent of rate): the next probe goes one
        # precision step up, which closes the bracket if it fails.
        edge = 1 + self.precision
        # Bracket: the lowest failing rate above the highest passing one. The goodput is most
        # often near the start (the estimate, or just above the bar it passed): steps begin
        # small and grow while the verdict stays the same (x1.2, x1.2, x1.44, x2.07 ...).
        capped = best > 0 and result.split.prefill > 0  # stops once known below the best
        steps = _steps()
        if result.goodput > 0.0:  # passed at the start or at the bar: step up from there
            if self._near_edge(result.best):
                rate = result.goodput * edge
            elif capped and best > result.goodput * edge:
                rate = best  # one probe tells whether it can be the recommendation
            else:
                rate = max(rate, result.goodput * FIRST_STEP)
                next(steps)
        while result.failed_at is None:
            if rate > ceiling:
                result.saturated = True
                return
            if not self._probe(result, rate):
                break
            rate *= edge if self._near_edge(result.best) else next(steps)
        steps = _steps()
        while result.goodput == 0.0:
            rate = result.failed_at / next(steps)
            if rate < MIN_RATE:
                return
            self._probe(result, rate)
        done = edge * (1 + 1e-9)  # a bracket within the precision (rounding aside)
        while result.failed_at / result.goodput > done:
            if capped and result.failed_at <= best:
                result.below_best = True
                return
            rate = (result.failed_at * result.goodput) ** 0.5
            if self._near_edge(result.best):
                rate = min(rate, result.goodput * edge)
            self._probe(result, rate)

    def _confirm(self, result: SplitResult, best: float) -> None:
        """A goodput bracketed on short probes alone is judged again on the steady probe, and
        if it fails there searched down on steady probes: a short probe can pass on a burst
        that neither fills a batch nor shows a queue growing within it, where the workload
        itself changes over a longer one (agentic sessions' later turns, on longer contexts:
        70B on 1P:3D passed 600-request probes at 110 req/s with the busiest batch at 0.60 of
        max_num_seqs and TTFT growth 1.08, and failed 8192-request probes from 96). So every
        goodput the search reports passed a probe of `steady` length.

        That holds for a split already `steady` too: it turns steady at a building pass, and
        when that pass lies above a short pass and fails on the steady probe, the bracket can
        close on the short pass below it (70B chat at TTFT <= 200 ms, `auto` on 1P:3D: short
        probes passed 190.9 and 193.1 req/s, the steady one failed 193.1, and 190.9 was
        reported; on the steady probe 8% of requests met the SLOs there, and the split
        sustains 110.4)."""
        _, steady = self._sizes(result)
        # No pass (best None, goodput 0), one on a probe as long as the steady one (a sample
        # shorter than it included), or only bracketed below the best: nothing to confirm.
        if result.best is None or result.best.requests >= steady or result.below_best:
            return
        result.steady = True
        rate, result.goodput, result.best = result.goodput, 0.0, None
        if not self._probe(result, rate):
            result.saturated = False
            self._bracket(result, 0.0, best, rate)

    def _near_edge(self, probe: ProbeResult | None) -> bool:
        """Whether `probe` passed with at least NEAR_EDGE of the misses it was allowed."""
        if probe is None or not probe.passed:
            return False
        allowed = probe.requests - math.ceil(self.slo.attainment * probe.requests - 1e-9)
        return allowed > 0 and probe.missed >= NEAR_EDGE * allowed


def _steps() -> Iterator[float]:
    """FIRST_STEP twice, then each step the square of the one before."""
    step = FIRST_STEP
    yield step
    while True:
        yield step
        step *= step


def _bar(searched: list[SplitResult], top: int) -> float:
    """The lowest of the `top` best goodputs found so far, or of the goodputs found when
    fewer (at least two: the first wave's); 0 before. A split that fails there cannot be
    among the best `top`, or among those found."""
    goodputs = sorted((r.goodput for r in searched if r.goodput > 0), reverse=True)
    if len(goodputs) < 2:
        return 0.0
    return goodputs[min(top, len(goodputs)) - 1]


def _calibration(searched: list[SplitResult], split: Split) -> float:
    """goodput / estimate of the searched splits of `split`'s kind (colocated or
    disaggregated) nearest to it in prefill share, their geometric mean when several are as
    near; 1 without any. Neighbouring splits are served alike, so their errors are alike."""
    colocated = split.prefill == 0
    share = split.prefill / (split.prefill + split.decode)
    known = [
        (abs(r.split.prefill / (r.split.prefill + r.split.decode) - share), r.goodput / r.estimate)
        for r in searched
        if (r.split.prefill == 0) == colocated
        and r.goodput > 0 < r.estimate
        and not (r.saturated or r.below_best)
    ]
    if not known:
        return 1.0
    nearest = min(distance for distance, _ in known)
    ratios = [ratio for distance, ratio in known if distance <= nearest + 1e-9]
    return math.exp(sum(map(math.log, ratios)) / len(ratios))
