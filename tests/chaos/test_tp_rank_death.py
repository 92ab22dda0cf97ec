"""A tensor-parallel worker's follower rank dies while greedy load runs: its worker goes down
as a unit (rank 0 sees the follower end and exits; Ray restarts the worker with a new process
and new ranks), in-flight requests complete exactly through the router's failover or end with
a clear status, and afterwards no worker holds a block or reservation and output is exact.
Two colocated decode workers of TP 2 on CPU (Gloo), the built-in model."""

from __future__ import annotations

import random
import time

import pytest

from pdserve.bench.common.system_probe import settled_leftovers, worker_pids
from tests.chaos.test_chaos import (
    MAX_TOKENS,
    PROGRESS_TIMEOUT_S,
    SEED,
    assert_exact_or_clear,
    random_prompts,
    run_load,
    wait_all_healthy,
)
from tests.e2e.conftest import serve_config
from tests.e2e.test_disaggregated_serving import reference_outputs

VICTIM = "decode-0"


@pytest.fixture(scope="module")
def served(ray_cluster):
    from pdserve.app import BackgroundApp

    config = serve_config("grpc", prefill_workers=0, decode_workers=2, decode_tp=2)
    config.router.disaggregate = "never"
    config.router.progress_timeout_s = PROGRESS_TIMEOUT_S
    with BackgroundApp(config) as app:
        yield app


def follower_of(ray, worker_id: str):
    """The rank-1 actor of the worker's current incarnation (named by rank 0's pid)."""
    deadline = time.monotonic() + 60
    prefix = f"pdserve-{worker_id}-rank1-"
    while True:
        names = [n for n in ray.util.list_named_actors() if n.startswith(prefix)]
        if names:
            return ray.get_actor(names[-1]), names[-1]
        assert time.monotonic() < deadline, f"no rank actor named {prefix}*"
        time.sleep(0.5)


def test_a_dead_rank_takes_its_worker_down_and_requests_continue(served, ray_cluster):
    rng = random.Random(f"{SEED}-tp-rank")
    prompts = random_prompts(rng)
    expected = reference_outputs(prompts, [MAX_TOKENS] * len(prompts))
    wait_all_healthy(served)
    before = worker_pids(served.app)[VICTIM]
    follower, name = follower_of(ray_cluster, VICTIM)
    print(f"seed {SEED}: killing {name}")

    outcomes = run_load(served, prompts, lambda: ray_cluster.kill(follower, no_restart=True))
    assert_exact_or_clear(outcomes, expected)

    deadline = time.monotonic() + 120
    while worker_pids(served.app).get(VICTIM, before) == before:  # rank 0 went down too
        assert time.monotonic() < deadline, "rank 0 outlived its follower"
        time.sleep(0.5)
    wait_all_healthy(served)
    assert follower_of(ray_cluster, VICTIM)[1] != name  # new ranks with the new rank 0
    left = settled_leftovers(served.app, timeout_s=30.0)
    assert all(w.clean for w in left.values()), (SEED, left)
    prompts = random_prompts(rng)
    outcomes = run_load(served, prompts, chaos=lambda: None)
    assert [o.tokens for o in outcomes] == reference_outputs(prompts, [MAX_TOKENS] * len(prompts))
