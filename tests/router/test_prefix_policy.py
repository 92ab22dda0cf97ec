"""The `prefix` baseline policy: the longest cached prefix wins, ties go to the least loaded."""

from __future__ import annotations

import pytest

from pdserve.config import ConfigError, RouterConfig
from router.estimates import RoutingRequest, WorkerLoad
from router.policy import RoutingPolicy

REQUEST = RoutingRequest(prompt_tokens=1024, max_tokens=64, block_size=16, bytes_per_block=1 << 20)


def worker(worker_id: str, **load) -> WorkerLoad:
    return WorkerLoad(worker_id, num_blocks=4096, num_free_blocks=4096, **load)


def prefix_policy(disaggregate: str = "always") -> RoutingPolicy:
    return RoutingPolicy(RouterConfig(policy="prefix", disaggregate=disaggregate))


def test_the_longest_cached_prefix_wins_over_a_lighter_load() -> None:
    prefill = [worker("p0"), worker("p1", num_waiting=6, waiting_prompt_tokens=6000)]
    decode = [worker("d0"), worker("d1", num_running=3)]
    decision = prefix_policy().decide(REQUEST, prefill, decode, cached_blocks={"p1": 40, "p0": 8})
    assert decision.prefill_worker == "p1"
    assert decision.cached_tokens == 40 * 16
    assert decision.decode_worker == "d0"  # the decode side: least loaded


def test_ties_go_to_the_least_loaded_option() -> None:
    prefill = [worker("p0", num_waiting=2), worker("p1"), worker("p2", num_waiting=1)]
    decode = [worker("d0", num_running=5), worker("d1", num_running=1)]
    decision = prefix_policy().decide(REQUEST, prefill, decode, cached_blocks={})
    assert (decision.prefill_worker, decision.decode_worker) == ("p1", "d1")


def test_with_auto_a_decode_worker_holding_the_longest_prefix_prefills_locally() -> None:
    prefill = [worker("p0")]
    decode = [worker("d0"), worker("d1")]
    cached = {"p0": 10, "d1": 60}
    decision = prefix_policy("auto").decide(REQUEST, prefill, decode, cached_blocks=cached)
    assert (decision.prefill_worker, decision.decode_worker) == (None, "d1")


def test_prefix_is_a_router_policy_choice() -> None:
    assert RouterConfig(policy="prefix").policy == "prefix"
    with pytest.raises(ConfigError, match="policy"):
        RouterConfig(policy="longest_prefix")
