"""A probe collects young objects less often (probe.YOUNG_COLLECTION_ALLOCATIONS) and leaves
the cyclic collector's thresholds as it found them."""

from __future__ import annotations

import gc

import pytest

from pdserve.config import RouterConfig
from pdserve.planner.deployment import Deployment
from pdserve.planner.probe import SLO, Split, run_probe
from pdserve.planner.workload import PlanRequest, probe_sample


@pytest.fixture
def thresholds():
    before = gc.get_threshold()
    gc.set_threshold(500, 7, 9)
    yield
    gc.set_threshold(*before)


def test_a_probe_restores_the_collector_thresholds(planner_model_dir, thresholds):
    deployment = Deployment(
        str(planner_model_dir), max_num_seqs=8, max_num_batched_tokens=64, num_kv_blocks=256
    )
    sample = probe_sample([PlanRequest(10 + i, 4) for i in range(8)], 8, seed=1)
    run_probe(deployment, Split(0, 2), sample, 10.0, SLO(1e6, 1e6), RouterConfig())
    assert gc.get_threshold() == (500, 7, 9)
