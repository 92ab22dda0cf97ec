"""The peer pull as an option the policy weighs (--peer-pull): a local prefill on Y is priced
with the pull of the longest other holder's prefix (Y's queue + the pull + the prefill past
it), so the policy may prefer Y because it could pull; `plan_pull` then names the holder of
exactly the pull the chosen option priced."""

from __future__ import annotations

import pytest

from pdserve.config import RouterConfig
from router.cost_model import CostModel, LinearFit
from router.estimates import RoutingRequest, WorkerLoad
from router.peer_pull import peer_blocks, plan_pull, pull_seconds
from router.policy import RoutingPolicy

BLOCK = 16
BYTES_PER_BLOCK = 1 << 20
PROMPT = 1600  # 100 blocks


def fast_link() -> CostModel:
    """Prefill at 1 ms a token, transfers at 10 GB/s: pulling a block beats computing it."""
    cost = CostModel()
    cost.prefill = LinearFit(0.01, 1e-3, x_scale=512)
    cost.transfer = LinearFit(0.001, 1e-10, x_scale=16 << 20)
    return cost


def decide(peer_pull: bool, cost: CostModel, cached: dict[str, int]):
    config = RouterConfig(disaggregate="never", peer_pull=peer_pull, ttft_slo_ms=5000.0)
    request = RoutingRequest(PROMPT, 16, BLOCK, BYTES_PER_BLOCK)
    # X holds the prompt but has a long prompt queue; Y is idle and holds nothing.
    busy = WorkerLoad("x", num_waiting=1, waiting_prompt_tokens=500)
    idle = WorkerLoad("y")
    return RoutingPolicy(config, cost).decide(request, [], [busy, idle], cached)


def test_the_policy_prefers_the_idle_worker_because_it_can_pull():
    cost = fast_link()
    cached = {"x": 90}
    without = decide(False, cost, cached)
    pulled = decide(True, cost, cached)
    assert without.decode_worker == "x"  # recomputing 1600 tokens on Y is dearer than X's queue
    assert pulled.decode_worker == "y" and pulled.chosen.pulled_blocks == 90
    own = pulled.estimates["local@y"]
    pull_s = pull_seconds(cost, 90, BYTES_PER_BLOCK)
    assert own.pull_s == pull_s
    # Y's queue (empty) + the pull + the prefill of the tokens past X's prefix.
    assert own.ttft_s == pytest.approx(
        pull_s + cost.prefill_seconds(PROMPT - 90 * BLOCK, local=True)
    )
    assert own.compute_s == cost.prefill_seconds(PROMPT - 90 * BLOCK, local=True)
    assert own.ttft_s < without.estimates["local@y"].ttft_s
    # The holder's own option pulls nothing (no other worker holds more).
    assert pulled.estimates["local@x"].pulled_blocks == 0
    # The router's plan of the chosen option is the pull the policy priced.
    plan = plan_pull(cost, "y", PROMPT, BLOCK, BYTES_PER_BLOCK, cached, ["x", "y"])
    assert (plan.holder, plan.pulled_blocks, plan.pull_s) == ("x", 90, own.pull_s)


def test_no_pull_is_priced_where_it_does_not_beat_the_recompute():
    slow_link = fast_link()
    slow_link.transfer = LinearFit(0.001, 1e-7, x_scale=16 << 20)  # 10 MB/s
    decision = decide(True, slow_link, {"x": 90})
    assert all(o.pulled_blocks == 0 and o.pull_s == 0.0 for o in decision.estimates.values())
    assert plan_pull(slow_link, "y", PROMPT, BLOCK, BYTES_PER_BLOCK, {"x": 90}, ["x"]) is None


def test_peer_blocks_are_the_longest_other_holders_below_the_last_token():
    cached = {"a": 50, "b": 20, "c": 200}
    assert peer_blocks(["a", "b", "c"], cached, 1601, BLOCK) == {"a": 100, "b": 100, "c": 50}
    assert peer_blocks(["a", "b"], {"a": 50, "b": 50}, 1600, BLOCK) == {"a": 50, "b": 50}
    assert peer_blocks(["a"], cached, 1600, BLOCK) == {"a": 0}
    # A holder outside the workers given (unhealthy, excluded) is nobody's peer.
    assert peer_blocks(["a", "b"], cached, 1600, BLOCK) == {"a": 20, "b": 50}
