"""Fixtures shared by every test package."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
# Each test worker starts its own Ray clusters, servers and models: more workers than this
# would trade memory for little time.
MAX_TEST_WORKERS = 4

if "PYTEST_XDIST_WORKER" in os.environ:
    # One thread for torch's operators in each test worker and what it starts (Ray workers,
    # subprocesses): the workers already fill the cores, and OpenMP threads that outnumber
    # them spin-wait on each other (kernel choice took 2.8 s instead of 0.2 s beside two busy
    # processes on 2 cores). A test that times threads sets its own count.
    os.environ["OMP_NUM_THREADS"] = "1"


def pytest_xdist_auto_num_workers(config) -> int:
    """`-n auto`: the CPUs this process may run on, at most MAX_TEST_WORKERS (xdist's own
    count is physical cores, which would be 1 where a runner's 2 vCPUs are one core's
    hyperthreads)."""
    return max(1, min(len(os.sched_getaffinity(0)), MAX_TEST_WORKERS))


@pytest.fixture(autouse=True)
def cpu_share(request, tmp_path_factory):
    """Beside other test workers, a test marked `times_the_real_system` runs alone: it compares
    timings of the real system measured minutes apart, which another worker's load would move
    (sim/real TTFT p50 1.77 once so). Every other test shares the cores. A gate lock held by
    the one waiting to run alone keeps new shared holders out until it has run."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        yield
        return
    alone = request.node.get_closest_marker("times_the_real_system") is not None
    shared_root = tmp_path_factory.getbasetemp().parent  # the workers' common base
    with open(shared_root / "cpu.gate", "a") as gate, open(shared_root / "cpu.lock", "a") as lock:
        fcntl.flock(gate, fcntl.LOCK_EX)
        fcntl.flock(lock, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        if not alone:
            fcntl.flock(gate, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
            fcntl.flock(gate, fcntl.LOCK_UN)


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
