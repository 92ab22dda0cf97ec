"""Fixtures shared by every test package."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
# Each test worker starts its own Ray clusters, servers and models: more workers than this
# would trade memory for little time.
MAX_TEST_WORKERS = 4


def pytest_xdist_auto_num_workers(config) -> int:
    """`-n auto`: the CPUs this process may run on, at most MAX_TEST_WORKERS (xdist's own
    count is physical cores, which would be 1 where a runner's 2 vCPUs are one core's
    hyperthreads)."""
    return max(1, min(len(os.sched_getaffinity(0)), MAX_TEST_WORKERS))


@pytest.fixture(scope="session")
def ray_cluster():
    """One real local Ray cluster for the whole session (Ray allows one per process).

    Both pools are advertised so any test can place prefill and decode actors; Ray workers
    inherit PYTHONPATH, so actor classes defined in test modules import there too.
    """
    import ray

    path = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), path) if p)
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        resources={"prefill_pool": 8, "decode_pool": 8},
    )
    yield ray
    ray.shutdown()
