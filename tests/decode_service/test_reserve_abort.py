"""reserve() and abort() of one request racing on the decode worker's event loop."""

from __future__ import annotations

import asyncio
import threading

from pdserve.core.messages import WorkRequest
from pdserve.core.sampling_params import SamplingParams
from tests.decode_service.workers import drain, running_workers, used_blocks

PROMPT = list(range(10, 40))


def test_abort_while_the_engine_reserves_undoes_the_reservation():
    async def scenario() -> None:
        async with running_workers() as (decode, _prefill):
            gate = threading.Event()
            decode._runtime.loop.call(gate.wait)  # the engine thread waits: reserve queues
            work = WorkRequest("r", PROMPT, SamplingParams(max_tokens=4))
            reserving = asyncio.ensure_future(decode.reserve(work))
            await asyncio.sleep(0.1)  # reserve() is waiting for engine.reserve
            aborting = asyncio.ensure_future(decode.abort("r"))
            await asyncio.sleep(0.1)  # abort() queued engine.abort behind it
            gate.set()
            reservation = await reserving
            await aborting
            assert reservation is None
            assert decode._receiver.open_transfer_ids() == []  # no transfer on freed blocks
            assert await used_blocks(decode) == 0
            stats = await decode.stats()
            assert stats.num_reserved == 0
            assert len(decode._handoffs) == 0
            batches = await drain(decode, "r")  # nothing to stream: ends as aborted
            assert [b.finish_reason for b in batches] == ["abort"]

    asyncio.run(scenario())


def test_abort_before_the_transfer_opened_then_reserving_again_works():
    async def scenario() -> None:
        async with running_workers() as (decode, _prefill):
            work = WorkRequest("r", PROMPT, SamplingParams(max_tokens=4))
            await decode.abort("r")  # unknown request: a no-op
            reservation = await decode.reserve(work)
            assert reservation is not None
            assert decode._receiver.open_transfer_ids() == [reservation.transfer_id]
            await decode.abort("r")
            assert decode._receiver.open_transfer_ids() == []
            assert await used_blocks(decode) == 0 and len(decode._handoffs) == 0

    asyncio.run(scenario())
