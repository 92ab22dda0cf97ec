"""abort() reaching the prefill worker before the prefill() it aborts (Ray does not order an
async actor's calls): the prompt is never computed, and no block stays held on either worker."""

from __future__ import annotations

import asyncio
import threading

import pytest

from pdserve.core.messages import WorkRequest
from pdserve.core.sampling_params import SamplingParams
from prefill_service.worker import PrefillAborted
from tests.decode_service.workers import running_workers, used_blocks

PROMPT = list(range(10, 40))
FREED_WITHIN_S = 1.0


async def freed_within(worker, seconds: float) -> int:
    """The worker's used blocks once they reach 0, or after `seconds`."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while (used := await used_blocks(worker)) and loop.time() < deadline:
        await asyncio.sleep(0.02)
    return used


async def first_results(prefill, work, reservation) -> list:
    return [result async for result in prefill.prefill(work, reservation)]


def test_abort_before_the_prefill_starts_skips_it_and_holds_nothing():
    async def scenario() -> None:
        async with running_workers() as (decode, prefill):
            work = WorkRequest("r", PROMPT, SamplingParams(max_tokens=4))
            reservation = await decode.reserve(work)
            assert reservation is not None
            # The router's abort of the attempt, both workers, before P's prefill() began.
            await asyncio.gather(prefill.abort("r"), decode.abort("r"))
            with pytest.raises(PrefillAborted):
                await first_results(prefill, work, reservation)
            assert await freed_within(prefill, FREED_WITHIN_S) == 0
            assert await freed_within(decode, FREED_WITHIN_S) == 0
            assert (await prefill.stats()).num_held == 0

    asyncio.run(scenario())


def test_abort_racing_the_request_into_the_engine_holds_nothing():
    async def scenario() -> None:
        async with running_workers() as (decode, prefill):
            work = WorkRequest("r", PROMPT, SamplingParams(max_tokens=4))
            reservation = await decode.reserve(work)
            assert reservation is not None
            gate = threading.Event()
            prefill._runtime.loop.call(gate.wait)  # the engine thread waits: calls queue
            aborting = asyncio.ensure_future(prefill.abort("r"))
            await asyncio.sleep(0.1)  # abort() queued engine.abort (a no-op: nothing added yet)
            prefilling = asyncio.ensure_future(first_results(prefill, work, reservation))
            await asyncio.sleep(0.1)  # prefill() opened its stream and queued its request
            gate.set()
            await asyncio.gather(aborting, decode.abort("r"))
            with pytest.raises(PrefillAborted):
                await prefilling
            assert await freed_within(prefill, FREED_WITHIN_S) == 0
            assert await freed_within(decode, FREED_WITHIN_S) == 0
            assert (await prefill.stats()).num_held == 0

    asyncio.run(scenario())


def test_a_prefill_not_aborted_still_hands_over():
    async def scenario() -> None:
        async with running_workers() as (decode, prefill):
            await prefill.abort("other")  # remembered aborts concern their own request only
            work = WorkRequest("r", PROMPT, SamplingParams(max_tokens=4))
            reservation = await decode.reserve(work)
            results = await first_results(prefill, work, reservation)
            assert len(results) == 2 and results[-1].transfer_bytes > 0
            assert await freed_within(prefill, FREED_WITHIN_S) == 0
            await decode.abort("r")

    asyncio.run(scenario())
