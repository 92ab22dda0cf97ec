"""The `approximate` policy (cache contents predicted from the router's own routes, no index)
and the `random` baseline."""

from __future__ import annotations

import pytest

from pdserve.config import ConfigError, RouterConfig
from pdserve.core.messages import WorkerStats
from router.approximate_prefixes import ApproximatePrefixes
from router.estimates import RoutingRequest, WorkerLoad
from router.policy import APPROXIMATE_BALANCE_ABS, RoutingPolicy
from router.routing import Routing
from router.worker_pool import WorkerPool

BLOCK = 16
REQUEST = RoutingRequest(prompt_tokens=1024, max_tokens=64, block_size=BLOCK)  # 64 full blocks


def worker(worker_id: str, **load) -> WorkerLoad:
    return WorkerLoad(worker_id, num_blocks=4096, num_free_blocks=4096, **load)


def policy(name: str) -> RoutingPolicy:
    return RoutingPolicy(RouterConfig(policy=name, disaggregate="never"))


def test_a_worker_holds_the_leading_blocks_it_was_sent() -> None:
    view = ApproximatePrefixes()
    view.add("w0", [1, 2, 3, 4], capacity=0)
    view.add("w1", [1, 2], capacity=0)
    assert view.lookup([1, 2, 3, 9], {"w0", "w1"}) == {"w0": 3, "w1": 2}
    assert view.lookup([1, 2, 3], {"w1"}) == {"w1": 2}  # only the workers asked about
    assert view.lookup([7, 2, 3], {"w0", "w1"}) == {}  # chained: no first block, nothing


def test_beyond_the_pool_the_least_recently_sent_go_tail_first() -> None:
    view = ApproximatePrefixes()
    view.add("w0", [1, 2, 3, 4], capacity=6)
    view.add("w0", [10, 11, 12, 13], capacity=6)
    # The first prompt's tail went first: its leading blocks, shared more, stay longest.
    assert view.held_blocks("w0") == 6
    assert view.lookup([1, 2, 3, 4], {"w0"}) == {"w0": 2}
    view.add("w0", [1, 2], capacity=6)  # sent again: now the youngest
    view.add("w0", [20, 21], capacity=6)
    assert view.lookup([1, 2], {"w0"}) == {"w0": 2}
    assert view.lookup([10, 11, 12, 13], {"w0"}) == {"w0": 2}
    view.forget("w0")
    assert view.lookup([1, 2], {"w0"}) == {}


def test_it_follows_a_cached_prefix_covering_most_of_the_prompt() -> None:
    decode = [worker("d0"), worker("d1", num_running=5)]
    decision = policy("approximate").decide(REQUEST, [], decode, cached_blocks={"d1": 40})
    assert decision.decode_worker == "d1"


def test_a_short_cached_prefix_goes_to_the_least_loaded() -> None:
    decode = [worker("d0"), worker("d1", num_running=5)]
    decision = policy("approximate").decide(REQUEST, [], decode, cached_blocks={"d1": 20})
    assert decision.decode_worker == "d0"  # 20 of 64 blocks: under the threshold


def test_out_of_balance_loads_override_the_cache() -> None:
    busy = APPROXIMATE_BALANCE_ABS + 1
    decode = [worker("d0", num_running=1), worker("d1", num_running=1 + busy)]
    decision = policy("approximate").decide(REQUEST, [], decode, cached_blocks={"d1": 64})
    assert decision.decode_worker == "d0"


def test_random_picks_every_worker_and_repeats_itself() -> None:
    decode = [worker(f"d{i}") for i in range(4)]

    def picks() -> list[str]:
        chooser = policy("random")
        return [chooser.decide(REQUEST, [], decode).decode_worker for _ in range(40)]

    first = picks()
    assert set(first) == {"d0", "d1", "d2", "d3"}
    assert picks() == first  # seeded


def test_the_router_routes_by_its_own_prediction_and_never_asks_the_index() -> None:
    class NoIndex:  # the index must not be asked under `approximate`
        def lookup(self, hashes):
            raise AssertionError("the approximate policy asked the index")

    pool = WorkerPool({}, {"decode-0": None, "decode-1": None})  # no actor is ever called
    for w in pool.workers.values():
        w.healthy = True
        w.stats = WorkerStats(w.worker_id, w.role, epoch=1, num_blocks=64, num_free_blocks=64)
    routing = Routing(pool, policy("approximate"), BLOCK, index=NoIndex())
    system = list(range(1, 513))  # 32 full blocks
    first = routing.choose(system + [1000], 8, set())
    again = routing.choose(system + [2000], 8, set())
    assert again.decode_worker == first.decode_worker
    assert again.cached_blocks == {first.decode_worker: 32}
    # A worker's restart (a new epoch in its stats) empties its predicted cache.
    holder = pool.workers[first.decode_worker]
    routing._learn_from_stats(holder, holder.stats, WorkerStats(
        holder.worker_id, "decode", epoch=2, num_blocks=64, num_free_blocks=64))  # fmt: skip
    assert routing.choose(system + [3000], 8, set()).cached_blocks == {}


def test_both_are_router_policy_choices() -> None:
    assert RouterConfig(policy="approximate").policy == "approximate"
    assert RouterConfig(policy="random").policy == "random"
    with pytest.raises(ConfigError, match="policy"):
        RouterConfig(policy="cache_aware")
