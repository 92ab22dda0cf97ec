"""RequestFlow in-process (tests/router/flow_cluster.py): full KV pools make a request wait for
room, then RESOURCE_EXHAUSTED; waiting requests are pending and a full router refuses at once."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from router.errors import status_for
from router.types import Overloaded
from tests.router.flow_cluster import (
    LETTERS,
    cluster,
    greedy,
    ids_of,
    run,
    script_after_prompt,
)


def test_a_refused_reservation_waits_for_room_instead_of_excluding_the_worker(
    tokenizer,
) -> None:
    async def scenario():
        c = await cluster(tokenizer, script_after_prompt(LETTERS), decode=1)
        decode = c.decode["decode-0"]
        decode.refuse_reservations = True

        async def free_blocks_later():
            await asyncio.sleep(0.2)
            decode.refuse_reservations = False

        freeing = asyncio.create_task(free_blocks_later())
        batches, progress = await c.generate(greedy(4))
        await freeing
        await c.pool.stop()
        return decode, batches, progress

    decode, batches, progress = run(scenario)
    assert ids_of(batches) == LETTERS[:4]
    assert decode.reservations > 1 and progress.decode_worker == "decode-0"


def test_a_full_kv_pool_is_resource_exhausted_not_unavailable(tokenizer) -> None:
    async def scenario():
        c = await cluster(tokenizer, script_after_prompt(LETTERS), room_wait_s=0.3)
        for worker in c.decode.values():
            worker.refuse_reservations = True
        started = time.monotonic()
        with pytest.raises(Overloaded) as refusal:
            await c.generate(greedy(4))
        waited = time.monotonic() - started
        await c.pool.stop()
        return c, refusal.value, waited

    c, error, waited = run(scenario)
    assert status_for(error)[0] == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "no free KV blocks" in str(error)
    assert waited >= 0.3
    assert c.leaked_blocks() == {}


def test_requests_waiting_for_room_are_pending_and_a_full_router_refuses_at_once(tokenizer):
    async def scenario():
        c = await cluster(
            tokenizer,
            script_after_prompt(LETTERS),
            decode=1,
            room_wait_s=10,
            max_pending_requests=3,
        )
        decode = c.decode["decode-0"]
        decode.refuse_reservations = True
        waiting = [
            asyncio.create_task(c.generate(greedy(4), request_id=f"waits-{i}")) for i in range(3)
        ]
        # Wait for the stage asserted below, not only the count: a request is pending from the
        # moment it is admitted, still in "workers" until its reservation is refused (CI once
        # read the stages in between).
        waiting_for_room = c.routing.pending_stages()["waiting_for_room"]
        deadline = time.monotonic() + 5
        while waiting_for_room() < 3 and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        pending = c.routing.pending()
        stages = {stage: count() for stage, count in c.routing.pending_stages().items()}
        started = time.monotonic()
        with pytest.raises(Overloaded) as refusal:
            await c.generate(greedy(4), request_id="one-too-many")
        took = time.monotonic() - started
        decode.refuse_reservations = False
        results = await asyncio.gather(*waiting)
        await c.pool.stop()
        return c, pending, stages, refusal.value, took, results

    c, pending, stages, error, took, results = run(scenario)
    assert pending == 3 and stages == {"workers": 0, "waiting_for_room": 3}
    assert "max_pending_requests=3" in str(error)
    assert status_for(error)[0] == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert took < 0.1
    assert all(ids_of(batches) == LETTERS[:4] for batches, _ in results)
    assert c.routing.pending() == 0 and c.leaked_blocks() == {}


def test_many_requests_on_a_small_kv_pool_wait_for_room_and_all_finish(tokenizer) -> None:
    # 16 blocks of 4 tokens hold 8 two-block prompts at once; 24 arrive together.
    async def scenario():
        c = await cluster(tokenizer, script_after_prompt(LETTERS), decode=1, num_blocks=16)
        c.decode["decode-0"].step_s = 0.005
        results = await asyncio.gather(
            *(c.generate(greedy(8), request_id=f"req-{i}") for i in range(24)),
            return_exceptions=True,
        )
        await c.pool.stop()
        return c, results

    c, results = run(scenario)
    errors = [r for r in results if isinstance(r, BaseException)]
    assert errors == []
    assert all(ids_of(batches) == LETTERS for batches, _ in results)
    assert c.leaked_blocks() == {}
