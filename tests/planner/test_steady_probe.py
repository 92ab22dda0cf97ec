"""A pass whose busiest worker came near a full batch is judged again on a longer probe, and the
split on probes that long from then on (Search._probe): a short probe ends before the queue
behind a full batch builds."""

from __future__ import annotations

from pdserve.config import RouterConfig
from pdserve.planner.deployment import Deployment
from pdserve.planner.probe import SLO, ProbeResult, Split, run_probe
from pdserve.planner.search import STEADY_TRIGGER, Search, steady_requests_per_worker
from pdserve.planner.workload import PlanRequest, probe_sample

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
