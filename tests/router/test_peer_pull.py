"""The router's side of a peer pull: when the cost model takes one (router/peer_pull.py), and
that a pull whose holder refuses or is marked unhealthy falls back at once, with the tokens a
plain local prefill gives (two real decode workers in this process, grpc between them)."""

from __future__ import annotations

import asyncio
import time

import pytest

from pdserve.core.messages import WorkRequest
from router.cost_model import CostModel, LinearFit
from router.peer_pull import PULL_MARGIN, PeerPull, plan_pull, start_pull
from router.worker_pool import WorkerPool
from tests.decode_service.test_kv_handoff import colocated, tokens_of
from tests.decode_service.test_peer_pull import GREEDY, HELD, PROMPT, two_workers
from tests.decode_service.workers import drain

BLOCK = 4
BYTES_PER_BLOCK = 1 << 20


def priced(prefill_s_per_token: float, transfer_s_per_byte: float) -> CostModel:
    cost = CostModel()
    cost.prefill = LinearFit(0.01, prefill_s_per_token, x_scale=512)
    cost.transfer = LinearFit(0.001, transfer_s_per_byte, x_scale=16 << 20)
    return cost


def plan(cost: CostModel, cached: dict[str, int], prompt_tokens: int = 400, healthy=("x", "y")):
    return plan_pull(cost, "y", prompt_tokens, BLOCK, BYTES_PER_BLOCK, cached, healthy)


def test_a_pull_is_taken_when_the_transfer_beats_the_recompute():
    pull = plan(priced(1e-3, 1e-10), {"x": 80, "y": 10, "z": 40}, healthy=("x", "y", "z"))
    assert (pull.holder, pull.own_blocks, pull.pulled_blocks) == ("x", 10, 80)
    assert pull.pull_s < PULL_MARGIN * pull.recompute_s
    assert pull.recompute_s == pytest.approx(70 * BLOCK * 1e-3)


def test_no_pull_when_the_transfer_is_dearer_than_the_margin_allows():
    # 70 blocks of 1 MiB at 1 GB/s (73 ms) against 280 tokens at 0.25 ms (70 ms).
    assert plan(priced(2.5e-4, 1e-9), {"x": 80, "y": 10}) is None


def test_no_pull_from_an_unhealthy_holder_or_one_that_holds_less():
    cost = priced(1e-3, 1e-10)
    assert plan(cost, {"x": 80, "y": 10}, healthy=("y",)) is None
    assert plan(cost, {"x": 10, "y": 10}) is None
    assert plan(cost, {"y": 80}) is None


def test_the_pull_stops_before_the_last_prompt_token():
    pull = plan(priced(1e-3, 1e-10), {"x": 100}, prompt_tokens=41)
    assert pull.pulled_blocks == 10  # 40 tokens: the 41st is computed by the puller
    assert plan(priced(1e-3, 1e-10), {"x": 100}, prompt_tokens=4) is None


def pool_of(x, y) -> WorkerPool:
    pool = WorkerPool({}, {"x": x, "y": y})
    for worker in pool.workers.values():
        worker.healthy = True
    return pool


@pytest.mark.parametrize("failure", ["refused", "unhealthy"])
def test_a_failed_pull_falls_back_at_once(failure):
    async def scenario() -> None:
        async with two_workers() as (x, y):
            pool = pool_of(x, y)
            blocks = HELD + 1 if failure == "refused" else HELD  # X never held block 7
            # Estimated at 2 s: the deadline (20 s) is not what ends the pull.
            pull = PeerPull("x", 0, blocks, BLOCK, pull_s=2.0, recompute_s=5.0)
            if failure == "unhealthy":
                pool.workers["x"].healthy = False  # as the router marks it mid-pull
            started = time.monotonic()
            assert await start_pull(pool, WorkRequest("r", PROMPT, GREEDY), "y", pull)
            assert tokens_of(await drain(y, "r")) == colocated(PROMPT, GREEDY)
            assert time.monotonic() - started < 10
            stats = await y.stats()
            assert (stats.peer_pulls_fallen_back, stats.prefix_peer_hit_tokens) == (1, 0)
            assert stats.num_used_blocks == (await x.stats()).num_used_blocks == 0

    asyncio.run(scenario())
