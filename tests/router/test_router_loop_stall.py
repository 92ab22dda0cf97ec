"""A stall of the router's own event loop (CPU throttling, a long GC, a starved host) is not
held against the workers (router/loop_lag.py): a request streaming across it finishes on its
first attempt, while a worker that is really frozen is still failed over."""

from __future__ import annotations

import asyncio
import time

from router.loop_lag import LoopLag
from tests.router.flow_cluster import (
    LETTERS,
    Cluster,
    cluster,
    greedy,
    ids_of,
    run,
    script_after_prompt,
)

HEARTBEAT_TIMEOUT_S = 0.3
STALL_S = 1.0  # over three heartbeat timeouts


def stall_the_loop_soon(seconds: float) -> None:
    """Blocks the running event loop for `seconds`, 50 ms from now."""
    asyncio.get_running_loop().call_later(0.05, time.sleep, seconds)


async def watched_cluster(tokenizer) -> Cluster:
    """Toy workers failed over at HEARTBEAT_TIMEOUT_S, whose heartbeats and stats polls take a
    round trip: in-process answers that took none would come in before the router looked."""
    c = await cluster(
        tokenizer,
        script_after_prompt(LETTERS),
        progress_timeout_s=HEARTBEAT_TIMEOUT_S,
        heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S,
    )
    for worker in c.workers:
        worker.round_trip_s = 0.01
    return c


def test_the_lag_counts_a_stall_before_the_ticker_runs_again() -> None:
    async def scenario():
        lag = LoopLag(tick_s=0.01)
        ticker = asyncio.create_task(lag.run_forever())
        await asyncio.sleep(0.05)
        before, then = lag.total_s(), time.monotonic()
        time.sleep(0.5)  # the loop stalls: the ticker cannot run
        seen = lag.total_s() - before
        net = lag.net_since(then, before)
        ticker.cancel()
        return seen, net

    seen, net = asyncio.run(scenario())
    assert 0.45 <= seen < 0.6
    assert abs(net) < 0.05  # none of the stall counts as time the loop ran


def test_a_request_streaming_across_a_router_stall_stays_on_its_workers(tokenizer) -> None:
    async def scenario():
        c = await watched_cluster(tokenizer)
        # A decode step outlasts the stall: the router waits on it when the stall ends, and
        # the answers to its heartbeats are not in yet.
        c.decode["decode-0"].step_s = STALL_S + 0.2
        stall_the_loop_soon(STALL_S)
        batches, progress = await c.generate(greedy(3))
        await asyncio.sleep(HEARTBEAT_TIMEOUT_S)  # heartbeats sent at the stall have timed out
        healthy = {w.worker_id: w.healthy for w in c.pool.workers.values()}
        failures = dict(c.pool.failures)
        await c.pool.stop()
        return c, batches, progress, healthy, failures

    c, batches, progress, healthy, failures = run(scenario)
    assert ids_of(batches) == LETTERS[:3]
    assert progress.attempts == 1 and progress.decode_worker == "decode-0"
    assert all(healthy.values()) and failures == {}
    assert c.pool.loop_lag.total_s() >= STALL_S * 0.9
    assert c.leaked_blocks() == {}


def test_a_frozen_worker_is_still_failed_over_after_a_router_stall(tokenizer) -> None:
    async def scenario():
        c = await watched_cluster(tokenizer)
        frozen = c.decode["decode-0"]
        frozen.step_s = 0.05
        frozen.freeze_after_tokens = 2
        stall_the_loop_soon(STALL_S)
        started = time.monotonic()
        batches, progress = await c.generate(greedy(8))
        failover_s = time.monotonic() - started
        healthy = c.pool.workers["decode-0"].healthy
        frozen.thaw()
        await asyncio.sleep(0.05)  # the queued abort runs once it thaws
        await c.pool.stop()
        return c, batches, progress, failover_s, healthy

    c, batches, progress, failover_s, healthy = run(scenario)
    assert ids_of(batches) == LETTERS and progress.attempts == 2
    assert not healthy
    # The stall, then the heartbeat timeout of loop time, then a margin for a loaded host.
    assert failover_s < STALL_S + HEARTBEAT_TIMEOUT_S + 1.0
    assert c.leaked_blocks() == {}


def test_the_served_router_counts_its_stalls_for_prometheus(tokenizer) -> None:
    from prometheus_client import REGISTRY

    from pdserve.app.stats_listeners import export_worker_stats

    def counted() -> float:
        return REGISTRY.get_sample_value("pdserve_router_loop_stall_seconds_total") or 0.0

    async def scenario():
        c = await cluster(tokenizer, script_after_prompt(LETTERS))
        export_worker_stats(c.pool, "m", speculates=False)  # as pdserve/app wires the pool
        await asyncio.sleep(0.1)  # the pool's ticker has started
        before = counted()
        time.sleep(0.5)  # the loop stalls
        await asyncio.sleep(0.1)  # the ticker runs again
        await c.pool.stop()
        return counted() - before

    assert 0.45 <= run(scenario) < 1.0
