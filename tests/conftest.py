"""Fixtures shared by every test package."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]


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
