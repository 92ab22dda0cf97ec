"""The search: goodput of every split of the GPUs, by bisection over the request rate.

Goodput (DistServe's) is the highest rate at which at least `slo.attainment` of the requests
meet both SLOs. Each split's search starts from `capacity_estimate` (throughput bounds from the
timing model: prefill at full steps, decode at full batches, colocated steps mixing both) and
walks up while probes pass, or down until one passes (a failing probe is cheap: it stops as
soon as the misses exceed what the attainment allows), by steps of 1.2x, 1.2x, then squaring,
then bisects geometrically until the bracket is within `precision`.
The `top` splits of best estimate are searched first; every other split is then first probed
at the lowest of their goodputs, and dropped (`pruned`) when it fails there: it cannot be
among the best; one that passes starts from its estimate scaled by how far the first round's
goodputs of its kind (colocated or disaggregated) lay from theirs. Colocated is reported as the recommendation unless the best disaggregated
split beats it by more than `precision`.

The splits of each of those two rounds are independent of one another, so `jobs` processes
(forked: they share the deployment and sample) search them in parallel; the plan is the same
for any `jobs`, as each split's probes depend only on its own results and the round's
threshold.

Replicas: a split whose worker counts share a factor k is simulated as one of its k identical
replicas (P/k prefill and D/k decode workers) at 1/k of the rate, as DistServe replicates a
placement: the router spreads load evenly over identical workers, and a probe of a smaller
cluster needs proportionally fewer requests to reach the same load. Every simulated replica
keeps at least `min_replica_workers` workers, so the router still chooses among several.
A probe offers `requests_per_worker` requests per simulated worker (at most the sample).
"""

from __future__ import annotations

import math
import multiprocessing
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field

from pdserve.config import RouterConfig
from pdserve.planner.cluster import RouterTiming
from pdserve.planner.deployment import Deployment
from pdserve.planner.probe import SLO, ProbeResult, Split, run_probe
from pdserve.planner.workload import ProbeRequest
from pdserve.sim.timing import Chunk, StepWork

MIN_RATE = 1e-3  # requests/s: below this a split serves nothing within the SLOs
# A split still passing at this multiple of its estimate absorbs the whole sample as one
# burst: its goodput is reported as at least that rate (`saturated`), more requests per probe
# would tell more.
MAX_OVER_ESTIMATE = 16
# The bracket's first step from the start rate (see Search._search): 1.2 is bisected within 5%
# in two probes.
FIRST_STEP = 1.2


@dataclass
class SplitResult:
    split: Split
    estimate: float  # requests/s the timing model's throughput bounds allow
    replicas: int = 1  # the split is simulated as one of this many identical replicas
    goodput: float = 0.0  # highest rate that passed (0: none did)
    failed_at: float | None = None  # lowest rate that failed
    best: ProbeResult | None = None  # the probe at `goodput`
    probes: list[ProbeResult] = field(default_factory=list)
    pruned: bool = False  # failed at the top splits' lowest goodput: not searched further
    saturated: bool = False  # passed even at MAX_OVER_ESTIMATE x the estimate


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
        colocated = next((r for r in self.results if r.split.prefill == 0), None)
        best = self.best
        if colocated is not None and best.goodput <= colocated.goodput * (1 + self.precision):
            return colocated
        return best


def all_splits(workers: int) -> list[Split]:
    """Colocated over every worker, and every P:D with P + D = workers."""
    return [Split(0, workers)] + [Split(p, workers - p) for p in range(1, workers)]


def replica_count(split: Split, min_workers: int) -> int:
    """The most identical replicas `split` divides into, each of at least `min_workers`."""
    common = math.gcd(split.prefill, split.decode)
    workers = split.prefill + split.decode
    fits = [k for k in range(1, common + 1) if common % k == 0 and workers // k >= min_workers]
    return max(fits, default=1)


def capacity_estimate(deployment: Deployment, split: Split, sample: list[ProbeRequest]) -> float:
    """Requests/s the split could serve at best: prefill workers computing full steps, decode
    workers decoding full batches (colocated workers mix the two in their steps)."""
    engine, meter = deployment.new_engine()
    timing, config = meter.timing, deployment.engine_config
    prompt = sum(len(r.prompt) for r in sample) / len(sample)
    output = sum(r.output_len for r in sample) / len(sample)
    chunk = min(config.max_num_batched_tokens, max(1, round(prompt)))
    prefill_step = timing.step_seconds(StepWork.of([Chunk(0, chunk, False)], 1))
    prefill_rate = chunk / prefill_step / prompt  # prompts/s of one worker
    context = round(prompt + output / 2)
    batch = max(1, min(config.max_num_seqs, engine.block_manager.num_blocks * config.block_size
                       // max(1, round(prompt + output))))  # fmt: skip
    decode_step = timing.step_seconds(StepWork.of([Chunk(context, 1, True)] * batch, batch))
    decode_rate = batch / decode_step / output  # requests/s of one worker
    if split.prefill == 0:
        shared = 1 / (1 / prefill_rate + 1 / decode_rate)  # prefill and decode steps in turn
        # The scheduler mixes them: a step decodes the batch and computes the prompts of the
        # requests that replace the ones it finishes (within the step's token budget).
        prompt_tokens = min(round(batch * prompt / output), config.max_num_batched_tokens - batch)
        if prompt_tokens < 1:
            return split.decode * shared
        chunks = [Chunk(context, 1, True)] * batch + [Chunk(0, prompt_tokens, False)]
        mixed_step = timing.step_seconds(StepWork.of(chunks, batch + 1))
        mixed = min(batch / output, prompt_tokens / prompt) / mixed_step
        return split.decode * max(shared, mixed)
    return min(split.prefill * prefill_rate, split.decode * decode_rate)


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
        min_replica_workers: int = 2,
        on_probe: Callable[[ProbeResult], None] | None = None,
        jobs: int = 1,
    ) -> None:
        """`jobs` > 1: splits are searched in that many forked processes (`on_probe` is then
        called in them)."""
        self.deployment, self.sample, self.slo = deployment, sample, slo
        self.router_config, self.timing = router_config, timing
        self.precision, self.top = precision, top
        self.requests_per_worker = requests_per_worker
        self.min_replica_workers = min_replica_workers
        self.on_probe = on_probe
        self.jobs = jobs
        self.probes = 0

    def run(self, splits: list[Split]) -> Plan:
        started = time.perf_counter()
        results = [
            SplitResult(
                s,
                capacity_estimate(self.deployment, s, self.sample),
                replica_count(s, self.min_replica_workers),
            )
            for s in splits
        ]
        by_estimate = sorted(results, key=lambda r: -r.estimate)
        first, rest = by_estimate[: self.top], by_estimate[self.top :]
        self._search_all(first, 0.0, [r.estimate for r in first])
        goodputs = sorted((r.goodput for r in first if r.goodput > 0), reverse=True)
        threshold = goodputs[-1] if len(goodputs) >= self.top else 0.0
        # The rest start where the first round's goodputs put their estimates.
        starts = [r.estimate * _calibration(first, r.split.prefill == 0) for r in rest]
        self._search_all(rest, threshold, starts)
        results.sort(key=lambda r: (-r.goodput, r.pruned, r.split.prefill))
        self.probes = sum(len(r.probes) for r in results)
        return Plan(results, self.precision, time.perf_counter() - started, self.probes)

    def _search_all(
        self, results: list[SplitResult], threshold: float, starts: list[float]
    ) -> None:
        """Searches each of `results` in place (see `_search`), in `jobs` processes."""
        jobs = min(self.jobs, len(results))
        if jobs <= 1 or "fork" not in multiprocessing.get_all_start_methods():
            for result, start in zip(results, starts, strict=True):
                self._search(result, threshold, start)
            return
        global _FORKED_SEARCH
        _FORKED_SEARCH = self  # the forked workers inherit it: nothing large is pickled
        try:
            context = multiprocessing.get_context("fork")
            with ProcessPoolExecutor(jobs, mp_context=context) as pool:
                thresholds = [threshold] * len(results)
                searched = pool.map(_search_in_worker, results, thresholds, starts)
                for result, done in zip(results, searched, strict=True):
                    result.__dict__.update(done.__dict__)
        finally:
            _FORKED_SEARCH = None

    def _probe(self, result: SplitResult, rate: float) -> bool:
        k, split = result.replicas, result.split
        replica = Split(split.prefill // k, split.decode // k)
        size = self.requests_per_worker * (replica.prefill + replica.decode)
        probe, _ = run_probe(
            self.deployment,
            replica,
            self.sample[:size],
            rate / k,
            self.slo,
            self.router_config,
            self.timing,
        )
        probe.split, probe.rate = split, rate
        self.probes += 1
        result.probes.append(probe)
        if self.on_probe is not None:
            self.on_probe(probe)
        if probe.passed:
            if rate > result.goodput:
                result.goodput, result.best = rate, probe
        elif result.failed_at is None or rate < result.failed_at:
            result.failed_at = rate
        return probe.passed

    def _search(self, result: SplitResult, threshold: float, start: float) -> None:
        """Probes at `threshold` first (> 0) and prunes the split if it fails there; else
        brackets the goodput from `start` (or just above the threshold) and bisects."""
        if threshold > 0 and not self._probe(result, threshold):
            result.pruned = True
            return
        rate = max(start, threshold * FIRST_STEP, MIN_RATE)
        ceiling = max(rate, result.estimate * MAX_OVER_ESTIMATE)
        # Bracket: the lowest failing rate above the highest passing one. The goodput is most
        # often near the start (the estimate, or just above the threshold it passed): steps
        # begin small and grow while the verdict stays the same (x1.2, x1.2, x1.44, x2.07 ...).
        steps = _steps()
        while result.failed_at is None:
            if rate > ceiling:
                result.saturated = True
                return
            if not self._probe(result, rate):
                break
            rate *= next(steps)
        steps = _steps()
        while result.goodput == 0.0:
            rate = result.failed_at / next(steps)
            if rate < MIN_RATE:
                return
            self._probe(result, rate)
        while result.failed_at / result.goodput > 1 + self.precision:
            self._probe(result, (result.failed_at * result.goodput) ** 0.5)


_FORKED_SEARCH: Search | None = None  # the search whose splits forked workers are searching


def _search_in_worker(result: SplitResult, threshold: float, start: float) -> SplitResult:
    assert _FORKED_SEARCH is not None, "only a worker forked by Search._search_all"
    _FORKED_SEARCH._search(result, threshold, start)
    return result


def _steps() -> Iterator[float]:
    """FIRST_STEP twice, then each step the square of the one before."""
    step = FIRST_STEP
    yield step
    while True:
        yield step
        step *= step


def _calibration(searched: list[SplitResult], colocated: bool) -> float:
    """Geometric mean of goodput / estimate over the searched splits of the same kind
    (colocated or disaggregated) with a measured goodput; 1 without any."""
    ratios = [
        r.goodput / r.estimate
        for r in searched
        if (r.split.prefill == 0) == colocated and r.goodput > 0 < r.estimate and not r.saturated
    ]
    return math.exp(sum(map(math.log, ratios)) / len(ratios)) if ratios else 1.0
