"""Chaos on hybrid workers (`--hybrid`): three workers that each decode and prefill for the
others, every prompt prefilled on another worker (`--disaggregate always`), so a victim holds
requests in both roles at once. One is killed (SIGKILL) or frozen (SIGSTOP) under greedy load:
every request completes exactly or ends with a clear status (as tests/chaos/test_chaos.py
judges it), nothing is left held once the victim is back, and the system serves exactly again.
"""

from __future__ import annotations

import os
import random
import signal
from collections.abc import Iterator

import grpc
import pytest

from pdserve.bench.common.system_probe import worker_pids
from tests.chaos.test_chaos import (
    FAILOVER_S,
    MAX_TOKENS,
    SEED,
    assert_exact_or_clear,
    assert_recovered_clean_and_exact,
    chaos_app,
    random_prompts,
    run_load,
)
from tests.e2e.conftest import serve_config
from tests.e2e.test_disaggregated_serving import reference_outputs


@pytest.fixture(scope="module")
def served(ray_cluster) -> Iterator:
    config = serve_config("grpc", prefill_workers=0, decode_workers=3)
    config.router.hybrid = True
    with chaos_app(config) as app:
        yield app


def victim(served, rng: random.Random) -> str:
    return rng.choice(sorted(served.app.pool.workers))


def test_a_killed_hybrid_worker(served, rng):
    prompts = random_prompts(rng)
    expected = reference_outputs(prompts, [MAX_TOKENS] * len(prompts))
    dead = victim(served, rng)
    pids = worker_pids(served.app)
    print(f"seed {SEED}: SIGKILL {dead} (pid {pids[dead]})")
    outcomes = run_load(served, prompts, lambda: os.kill(pids[dead], signal.SIGKILL))
    assert_exact_or_clear(outcomes, expected)
    assert_recovered_clean_and_exact(served, rng)
    assert worker_pids(served.app)[dead] != pids[dead]  # Ray restarted it, hybrid again
    assert served.app.pool.workers[dead].stats.role == "hybrid"


def test_a_frozen_hybrid_worker_is_failed_over(served, rng):
    prompts = random_prompts(rng)
    expected = reference_outputs(prompts, [MAX_TOKENS] * len(prompts))
    frozen = worker_pids(served.app)[victim(served, rng)]
    print(f"seed {SEED}: SIGSTOP pid {frozen} until the load ends")
    try:
        outcomes = run_load(served, prompts, lambda: os.kill(frozen, signal.SIGSTOP))
    finally:
        os.kill(frozen, signal.SIGCONT)
    assert_exact_or_clear(outcomes, expected)
    # Two workers stayed up, each able to prefill and decode: every request completes.
    summary = [(o.code.name, round(o.seconds, 1), len(o.tokens)) for o in outcomes]
    assert all(o.code == grpc.StatusCode.OK for o in outcomes), (SEED, summary)
    assert max(o.seconds for o in outcomes) < FAILOVER_S, (SEED, summary)
    assert_recovered_clean_and_exact(served, rng)
