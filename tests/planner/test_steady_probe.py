"""A pass whose busiest worker came near a full batch, or whose last arrivals waited much longer
for their first token than earlier ones, is judged again on a longer probe, and the split on
probes that long from then on (Search._probe): a short probe ends before the queue behind a
full batch, or before a prefill queue, builds past the SLO."""

from __future__ import annotations

from pdserve.config import RouterConfig
from pdserve.planner.deployment import Deployment
from pdserve.planner.probe import SLO, ProbeResult, Split, run_probe
from pdserve.planner.search import (
    STEADY_GROWTH,
    STEADY_TRIGGER,
    Search,
    SplitResult,
    steady_requests_per_worker,
)
from pdserve.planner.workload import PlanRequest, probe_sample
from pdserve.workloads.metrics import LatencyStats

SHORT = 8  # requests per worker of the search's probes


def test_a_pass_near_a_full_batch_is_judged_again_on_a_longer_probe(planner_model_dir):
    deployment = Deployment(str(planner_model_dir), max_num_seqs=4, max_num_batched_tokens=1024)
    steady = steady_requests_per_worker(deployment)
    assert steady == 32
    workload = [PlanRequest(64 + 8 * (i % 5), 96) for i in range(200)]
    sample = probe_sample(workload, len(workload), seed=3)
    slo = SLO(ttft_ms=400, tpot_ms=40)
    router = RouterConfig(ttft_slo_ms=slo.ttft_ms, tpot_slo_ms=slo.tpot_ms)
    probed: list[ProbeResult] = []
    search = Search(
        deployment, sample, slo, router, precision=0.1, requests_per_worker=SHORT,
        on_probe=probed.append,
    )  # fmt: skip
    result = search.run([Split(0, 1)]).best
    first = next(
        i for i, p in enumerate(probed) if p.passed and p.peak_batch >= STEADY_TRIGGER
    )  # a short one: every probe before it was short
    assert all(p.requests == SHORT for p in probed[: first + 1])
    assert (probed[first + 1].rate, probed[first + 1].requests) == (probed[first].rate, steady)
    assert all(p.requests == steady for p in probed[first + 1 :])
    assert result.steady and result.best.requests == steady
    # The short probe passes where the long ones put the knee: it would have rated the split
    # higher.
    short, _ = run_probe(deployment, Split(0, 1), sample[:SHORT], result.failed_at, slo, router)
    assert short.passed and short.peak_batch >= STEADY_TRIGGER


def _prefill_bound(planner_model_dir):
    """One worker whose batches stay small (long prompts, 4 tokens out): its queue is the
    prompts waiting for their prefill."""
    deployment = Deployment(str(planner_model_dir), max_num_seqs=64, max_num_batched_tokens=2048)
    workload = [PlanRequest(1800 + 16 * (i % 7), 4) for i in range(600)]
    slo = SLO(ttft_ms=1000, tpot_ms=100)
    router = RouterConfig(ttft_slo_ms=slo.ttft_ms, tpot_slo_ms=slo.tpot_ms)
    return deployment, probe_sample(workload, len(workload), seed=3), slo, router


def test_ttft_growth_is_near_one_below_the_knee_and_grows_past_it(planner_model_dir):
    deployment, sample, slo, router = _prefill_bound(planner_model_dir)
    below, _ = run_probe(deployment, Split(0, 1), sample[:512], 10, slo, router)
    assert 0.9 <= below.ttft_growth <= 1.1
    past, _ = run_probe(
        deployment, Split(0, 1), sample[:512], 30, slo, router, stop_when_certain=False
    )
    assert past.ttft_growth > 1.4


def test_a_pass_whose_queue_builds_before_any_batch_fills_is_judged_again(planner_model_dir):
    deployment, sample, slo, router = _prefill_bound(planner_model_dir)
    steady = steady_requests_per_worker(deployment)
    probed: list[ProbeResult] = []
    search = Search(
        deployment, sample, slo, router, precision=0.1, requests_per_worker=16,
        on_probe=probed.append,
    )  # fmt: skip
    result = search.run([Split(0, 1)]).best
    first = next(i for i, p in enumerate(probed) if p.passed and p.ttft_growth >= STEADY_GROWTH)
    assert probed[first].requests == 16 and probed[first].peak_batch < STEADY_TRIGGER
    assert (probed[first + 1].rate, probed[first + 1].requests) == (probed[first].rate, steady)
    assert result.steady and result.best.requests == steady
    # The short probe passes where the long ones put the knee: it would have rated the split
    # higher.
    short, _ = run_probe(deployment, Split(0, 1), sample[:16], result.failed_at, slo, router)
    assert short.passed and short.peak_batch < STEADY_TRIGGER


def test_a_goodput_found_on_short_probes_is_confirmed_on_a_steady_one(planner_model_dir):
    """The short probes offer the sample's first requests only, short prompts that pass at any
    rate without filling a batch or building a queue; the rest of the sample is long prompts.
    The goodput they bracket is judged again on the steady probe, fails there, and is searched
    down on steady probes: the split is rated by what it sustains on the whole workload."""
    deployment = Deployment(str(planner_model_dir), max_num_seqs=64, max_num_batched_tokens=2048)
    steady = steady_requests_per_worker(deployment)
    workload = [PlanRequest(64, 4)] * 64 + [PlanRequest(1800 + 16 * (i % 7), 4) for i in range(536)]
    sample = probe_sample(workload, len(workload), seed=3)
    slo = SLO(ttft_ms=1000, tpot_ms=100)
    router = RouterConfig(ttft_slo_ms=slo.ttft_ms, tpot_slo_ms=slo.tpot_ms)
    probed: list[ProbeResult] = []
    search = Search(
        deployment, sample, slo, router, precision=0.1, requests_per_worker=64,
        on_probe=probed.append,
    )  # fmt: skip
    result = search.run([Split(0, 1)]).best
    shorts = [p for p in probed if p.requests == 64]
    assert shorts and all(p.passed and p.ttft_growth < STEADY_GROWTH for p in shorts)
    assert all(p.peak_batch < STEADY_TRIGGER for p in shorts)
    confirming = probed[len(shorts)]
    assert (confirming.requests, confirming.rate) == (steady, max(p.rate for p in shorts))
    assert not confirming.passed
    assert result.steady and result.best.requests == steady and not result.saturated
    assert result.goodput < confirming.rate / 2


class _ScriptedProbes(Search):
    """A Search whose probes answer from rules instead of the virtual cluster: the bisection
    and its confirmation under test, on verdicts chosen to reach one path through them."""

    def __init__(self, deployment, sample, short_knee, building_from, steady_knee):
        slo = SLO(ttft_ms=200, tpot_ms=50)
        router = RouterConfig(ttft_slo_ms=slo.ttft_ms, tpot_slo_ms=slo.tpot_ms)
        super().__init__(deployment, sample, slo, router, precision=0.02, requests_per_worker=SHORT)
        self.short_knee, self.building_from = short_knee, building_from
        self.steady_knee = steady_knee

    def _run(self, result, replica, size, rate, to_end=False):
        _, steady = self._sizes(result)
        passed = rate <= (self.steady_knee if size >= steady else self.short_knee)
        growth = 2.0 if size < steady and rate >= self.building_from else 1.0
        probe = ProbeResult(
            split=result.split, rate=rate, requests=size, good=size if passed else 0,
            missed=0 if passed else size, passed=passed, complete=True, elapsed_s=1.0,
            ttft=LatencyStats.of([0.1]), tpot=LatencyStats.of([0.02]),
            prefill_utilisation=0.5, decode_utilisation=0.5, ttft_growth=growth,
        )  # fmt: skip
        result.probes.append(probe)
        return probe


def test_a_short_pass_below_the_rate_a_split_turned_steady_at_is_confirmed(planner_model_dir):
    """Short probes pass up to 195 req/s and show a queue building from 192; steady ones pass
    up to 110. The split turns steady at a building pass near 192.7 whose steady probe fails,
    and the bracket then closes within the precision on the short pass below it, at 188.4.
    That goodput came from a short probe: it is judged again on the steady one and searched
    down, so the search reports what the split sustains."""
    deployment = Deployment(str(planner_model_dir), max_num_seqs=4, max_num_batched_tokens=1024)
    workload = [PlanRequest(64, 8) for _ in range(64)]
    sample = probe_sample(workload, len(workload), seed=3)
    search = _ScriptedProbes(deployment, sample, short_knee=195, building_from=192, steady_knee=110)
    steady = steady_requests_per_worker(deployment)
    result = SplitResult(Split(0, 1), estimate=180.0)
    search._search(result, bar=0.0, best=0.0, start=180.0)
    turned = next(p for p in result.probes if p.requests == steady)  # the building pass's
    assert not turned.passed
    below = max(p.rate for p in result.probes if p.passed and p.rate < turned.rate)
    assert below > 188 and turned.rate / below < 1.03  # a bracket within the precision
    assert result.steady and result.best.requests == steady
    assert 110 / 1.03 <= result.goodput <= 110
