"""The order of the search (`Search.run`): splits whose probes simulate fewer workers are
searched first, and every later split is first held to the bar the cheaper ones set; a
disaggregated split known to fall below the best is left bracketed (unless `rank_all`); a
pass near its knee steps up by the precision alone."""

from __future__ import annotations

import pytest

from pdserve.config import RouterConfig
from pdserve.planner.deployment import Deployment
from pdserve.planner.probe import SLO, ProbeResult, Split
from pdserve.planner.search import Plan, Search, SplitResult
from pdserve.planner.splits import all_splits, simulated_workers
from pdserve.planner.workload import PlanRequest, probe_sample
from pdserve.workloads.metrics import LatencyStats

PRECISION = 0.2
WORKERS = 6  # colocated 6 and 3P:3D simulate 2 workers, 2P:4D and 4P:2D 3, the rest 6


def _search(deployment_dir, rank_all: bool = False) -> tuple[Plan, list[ProbeResult]]:
    deployment = Deployment(str(deployment_dir), max_num_seqs=16, max_num_batched_tokens=2048)
    workload = [PlanRequest(600 if i % 3 else 64, 48) for i in range(240)]
    # A seed whose best split and colocated are not within the precision of each other: there
    # either may be recommended, by a bisection that happened to stop a step apart.
    sample = probe_sample(workload, len(workload), seed=0)
    slo = SLO(ttft_ms=300, tpot_ms=25)
    router = RouterConfig(ttft_slo_ms=slo.ttft_ms, tpot_slo_ms=slo.tpot_ms)
    probed: list[ProbeResult] = []
    search = Search(
        deployment,
        sample,
        slo,
        router,
        precision=PRECISION,
        top=2,
        requests_per_worker=30,
        on_probe=probed.append,
        rank_all=rank_all,
    )
    return search.run(all_splits(WORKERS)), probed


@pytest.fixture(scope="module")
def searched(planner_model_dir) -> tuple[Plan, list[ProbeResult]]:
    return _search(planner_model_dir)


def test_cheap_splits_set_the_bar_the_costly_ones_are_held_to(searched):
    plan, probed = searched

    by_split = {r.split: r for r in plan.results}
    costs = [simulated_workers(p.split, by_split[p.split].replicas) for p in probed]
    assert costs == sorted(costs), "a costlier split was probed before a cheaper one"
    assert sorted(set(costs)) == [2, 3, 6]
    first_wave = [r for r in plan.results if r.replicas == 3]  # colocated 6 and 3P:3D
    assert all(not r.pruned for r in first_wave)
    bar = min(r.goodput for r in first_wave)
    assert bar > 0
    pruned = [r for r in plan.results if r.pruned]
    assert pruned, "no split failed at the bar: the test needs one that does"
    for result in pruned:
        found = sorted((r.goodput for r in _cheaper(plan, result) if r.goodput > 0), reverse=True)
        assert result.probes[-1].rate == found[min(2, len(found)) - 1]
        assert not result.probes[-1].passed


def test_a_split_below_the_best_is_bracketed_unless_every_one_is_ranked(
    planner_model_dir, searched
):
    plan, _ = searched
    ranked, _ = _search(planner_model_dir, rank_all=True)

    assert plan.recommended.split == ranked.recommended.split
    assert plan.recommended.goodput == ranked.recommended.goodput
    bracketed = [r for r in plan.results if r.below_best]
    assert bracketed, "no split stopped below the best: the test needs one that does"
    for result in bracketed:
        best = max(r.goodput for r in _cheaper(plan, result))
        assert result.split.prefill > 0 and 0 < result.goodput < result.failed_at <= best
    assert not any(r.below_best for r in ranked.results)
    for result in ranked.results:
        if result.goodput > 0 and result.failed_at is not None:
            assert result.failed_at / result.goodput <= (1 + PRECISION) * (1 + 1e-9)


def _cheaper(plan: Plan, result: SplitResult) -> list[SplitResult]:
    cost = simulated_workers(result.split, result.replicas)
    return [r for r in plan.results if simulated_workers(r.split, r.replicas) < cost]


def _probe(rate: float, passed: bool, missed: int, requests: int = 100) -> ProbeResult:
    empty = LatencyStats.of([])
    return ProbeResult(
        Split(0, 2), rate, requests, requests - missed, missed, passed, True, 1.0, empty, empty,
        0.5, 0.5,
    )  # fmt: skip


def test_a_pass_near_its_knee_is_one_that_used_most_of_its_allowed_misses(planner_model_dir):
    deployment = Deployment(str(planner_model_dir), max_num_seqs=16)
    search = Search(deployment, [], SLO(300, 25, attainment=0.9), RouterConfig(), precision=0.05)

    assert search._near_edge(_probe(100.0, passed=True, missed=9))  # 9 of the 10 allowed
    assert not search._near_edge(_probe(100.0, passed=True, missed=5))
    assert not search._near_edge(_probe(100.0, passed=False, missed=11))
    assert not search._near_edge(None)
