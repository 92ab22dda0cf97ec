"""The live router of plan-validate starts every rate from its priors and, like the offline
router polling at time 0, from the workers' current counters (`set_routing(forget_costs=True)`):
the first poll after the swap is already a measurement. (Before, it only set the baseline: in
rag 1P:1D at 7.18 req/s the second request prefilled locally live and remotely offline, and the
two runs went apart from there; with the baseline the first 42 of 60 routes were the same.)"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pdserve.bench.simulation.sim_run import set_routing
from pdserve.config import RouterConfig
from pdserve.core.messages import WorkerStats
from router.policy import RoutingPolicy
from router.routing import Routing
from router.worker_pool import WorkerPool


def _stats(worker_id: str, role: str, prefill_tokens: int, prefill_seconds: float):
    return WorkerStats(
        worker_id=worker_id,
        role=role,
        epoch=1,
        prefill_tokens=prefill_tokens,
        prefill_seconds=prefill_seconds,
    )


def _served_router(forget_costs: bool) -> Routing:
    """A router whose pool has polled both workers after earlier rates (handles never called),
    its policy swapped as between two rates."""
    pool = WorkerPool({"prefill-0": None}, {"decode-0": None})
    routing = Routing(pool, RoutingPolicy(RouterConfig()), block_size=16)
    pool.record_stats(pool.workers["prefill-0"], _stats("prefill-0", "prefill", 50_000, 5.0))
    pool.record_stats(pool.workers["decode-0"], _stats("decode-0", "decode", 9_000, 0.9))
    set_routing(SimpleNamespace(app=SimpleNamespace(routing=routing)), forget_costs=forget_costs)
    return routing


def _first_prefill_polled(routing: Routing) -> None:
    """The rate's first prefill: 4096 tokens in 0.1 s on the prefill worker, then a poll."""
    worker = routing.pool.workers["prefill-0"]
    worker_stats = _stats("prefill-0", "prefill", 50_000 + 4096, 5.1)
    routing.pool.record_stats(worker, worker_stats)


def test_the_first_poll_after_forgetting_the_costs_is_learned_from():
    routing = _served_router(forget_costs=True)
    prior = routing.policy.cost.prefill_seconds(4096)
    assert routing.policy.cost.prefill.samples == 0  # the priors, not the earlier rates' lines
    _first_prefill_polled(routing)
    cost = routing.policy.cost
    assert cost.prefill.samples == 1
    # The measured 0.1 s pulls the line from the prior (0.42 s) towards it.
    assert cost.prefill_seconds(4096) < prior
    assert cost.prefill_seconds(4096) == pytest.approx(0.1, rel=0.5)


def test_kept_costs_go_on_learning_from_the_next_poll():
    routing = _served_router(forget_costs=False)
    learned = routing.policy.cost.prefill.samples
    _first_prefill_polled(routing)
    assert routing.policy.cost.prefill.samples == learned + 1
