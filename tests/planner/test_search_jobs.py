"""The search in forked processes (`Search(jobs=...)`, `pdserve plan --jobs`) finds the same
plan as in one: each split's probes depend only on its own verdicts and its round's threshold,
not on which process ran it or when."""

from __future__ import annotations

from pdserve.config import RouterConfig
from pdserve.planner.deployment import Deployment
from pdserve.planner.probe import SLO
from pdserve.planner.search import Plan, Search
from pdserve.planner.splits import all_splits
from pdserve.planner.workload import PlanRequest, probe_sample


def _plan(deployment: Deployment, jobs: int) -> Plan:
    # Mixed lengths: some splits pass the first round's threshold, others are pruned.
    workload = [PlanRequest(600 if i % 3 else 64, 48) for i in range(240)]
    sample = probe_sample(workload, len(workload), seed=2)
    slo = SLO(ttft_ms=300, tpot_ms=25)
    router = RouterConfig(ttft_slo_ms=slo.ttft_ms, tpot_slo_ms=slo.tpot_ms)
    search = Search(
        deployment, sample, slo, router, precision=0.2, top=2, requests_per_worker=60, jobs=jobs
    )
    return search.run(all_splits(4))


def _summary(plan: Plan) -> list[tuple]:
    return [
        (r.split, r.goodput, r.failed_at, r.pruned, r.saturated, [p.rate for p in r.probes])
        for r in plan.results
    ]


def test_two_jobs_find_the_plan_one_finds(planner_model_dir):
    deployment = Deployment(str(planner_model_dir), max_num_seqs=16, max_num_batched_tokens=2048)

    alone, forked = _plan(deployment, jobs=1), _plan(deployment, jobs=2)

    assert _summary(forked) == _summary(alone)
    assert forked.probes == alone.probes == sum(len(r.probes) for r in alone.results)
    assert any(r.goodput > 0 for r in alone.results)
    assert forked.best.best == alone.best.best  # the probe results came back whole
