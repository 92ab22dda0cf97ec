"""The router's Redis calls run off its event loop: a slow Redis delays the request being
routed, not every other request's stream (pdserve/prefix_index/lookup.py, router/routing.py)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from typing import TypeVar

import redis

import pdserve.prefix_index.lookup as lookup_module
import pdserve.prefix_index.redis_link as redis_link
from pdserve.core.block_hash import prompt_block_hashes
from pdserve.core.kv_events import KVEvent
from pdserve.core.messages import PrefillResult
from pdserve.prefix_index.lookup import PrefixIndex
from pdserve.prefix_index.publisher import PrefixIndexPublisher
from tests.router.test_routing import routing as routing_of

BS = 4
PROMPT = list(range(100, 132))  # 8 full blocks
HASHES = prompt_block_hashes(PROMPT, BS)
PAUSE_MS = 200
TIMEOUT_S = 2.0  # the index's socket timeout here, well over the pause: calls wait, then succeed
T = TypeVar("T")


def pause_every_client(url: str, ms: int) -> None:
    """Redis answers no client's command for `ms` (they wait): a slow or stalled server."""
    client = redis.Redis.from_url(url)
    client.execute_command("CLIENT", "PAUSE", ms, "ALL")
    client.close()


async def with_ticks(call: Awaitable[T]) -> tuple[T, int]:
    """`call`'s result, and how often a 5 ms ticker on the same loop ran while it was awaited."""
    ticks, done = 0, False

    async def ticker() -> None:
        nonlocal ticks
        while not done:
            await asyncio.sleep(0.005)
            ticks += 1

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0)
    try:
        result = await call
    finally:
        done = True
        await task
    return result, ticks


def test_a_routing_decision_waits_for_redis_while_the_event_loop_runs_on(redis_url: str) -> None:
    publisher = PrefixIndexPublisher(redis_url, "prefill-0", "m", BS)
    assert publisher.register()
    assert publisher.publish([KVEvent("stored", list(HASHES), len(HASHES) * BS)])
    index = PrefixIndex(redis_url, "m", BS, socket_timeout_s=TIMEOUT_S)
    routing = routing_of(index=index, block_size=BS)
    assert index.lookup(HASHES) == {"prefill-0": 8}  # connected, the script loaded
    pause_every_client(redis_url, PAUSE_MS)
    started = time.monotonic()

    async def decide():
        try:
            return await with_ticks(routing.choose_async(PROMPT, 8, set()))
        finally:
            await index.aclose()  # the loop's asyncio client too

    route, ticks = asyncio.run(decide())
    assert time.monotonic() - started >= PAUSE_MS / 1e3 * 0.8  # it did wait for Redis
    assert route.cached_blocks == {"prefill-0": 8}  # and used its answer
    # A lookup made on the loop (Routing.choose) stops the ticker for the whole pause (0-1
    # ticks); off the loop it ticks on, 40 times if idle, 7 once on a loaded CI host.
    assert ticks >= 3


def test_reuse_counts_are_written_off_the_loop_and_close_waits_for_them(redis_url: str) -> None:
    index = PrefixIndex(redis_url, "m", BS, socket_timeout_s=TIMEOUT_S)
    routing = routing_of(index=index, block_size=BS)
    route = routing.choose(PROMPT, 8, set())
    result = PrefillResult(
        request_id="r", worker_id=route.prefill_worker, first_token_id=1, first_logprob=None,
        finished=False, finish_reason=None, num_prompt_tokens=len(PROMPT),
        num_cached_tokens=8, queue_s=0.0, prefill_s=0.01,
    )  # fmt: skip
    pause_every_client(redis_url, PAUSE_MS)
    started = time.monotonic()
    for _ in range(3):
        routing.on_prefill_done(route, result)
    assert time.monotonic() - started < PAUSE_MS / 1e3 / 2  # returned without waiting
    index.close()  # runs the queued writes
    total = PrefixIndex(redis_url, "m", BS, socket_timeout_s=TIMEOUT_S).stats().total
    assert (total.hit_tokens, total.miss_tokens, total.requests) == (24, 72, 3)


def test_writes_queued_behind_a_stalled_redis_are_bounded(redis_url: str, monkeypatch) -> None:
    monkeypatch.setattr(lookup_module, "MAX_QUEUED_WRITES", 2)
    index = PrefixIndex(redis_url, "m", BS, socket_timeout_s=TIMEOUT_S)
    pause_every_client(redis_url, PAUSE_MS)
    for _ in range(5):
        index.in_background(index.record_reuse, "decode-0", 1, 1)
    assert index.dropped_writes == 3  # one running, one queued: the rest are counted, dropped
    index.close()
    assert PrefixIndex(redis_url, "m", BS, socket_timeout_s=TIMEOUT_S).stats().total.requests == 2


def test_a_burst_of_lookups_shares_a_bounded_set_of_connections(redis_url: str) -> None:
    index = PrefixIndex(redis_url, "m", BS, socket_timeout_s=TIMEOUT_S)
    admin = redis.Redis.from_url(redis_url)
    before = len(admin.client_list())
    pause_every_client(redis_url, PAUSE_MS)  # every lookup of the burst is in flight at once

    async def burst() -> list[dict[str, int]]:
        try:
            answers = await asyncio.gather(*(index.lookup_async(HASHES) for _ in range(100)))
            opened = len(admin.client_list()) - before
            return answers, opened
        finally:
            await index.aclose()

    answers, opened = asyncio.run(burst())
    assert answers == [{}] * 100  # nothing published: every lookup answered, none failed
    assert opened <= redis_link.MAX_ASYNC_CONNECTIONS, opened
    assert index.available
