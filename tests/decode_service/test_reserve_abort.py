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


def test_abort_before_reserve_started_reserves_nothing():
    """Ray does not order an async actor's calls: the router's abort can run first."""

    async def scenario() -> None:
        async with running_workers() as (decode, _prefill):
            await decode.abort("r")
            reservation = await decode.reserve(WorkRequest("r", PROMPT, SamplingParams()))
            assert reservation is None
            assert decode._receiver.open_transfer_ids() == []  # nothing waits out a deadline
            assert await used_blocks(decode) == 0 and len(decode._handoffs) == 0
            # Another request (a retry's id is another) reserves as usual.
            retry = await decode.reserve(WorkRequest("r#1", PROMPT, SamplingParams()))
            assert retry is not None
            assert decode._receiver.open_transfer_ids() == [retry.transfer_id]
            await decode.abort("r#1")
            assert decode._receiver.open_transfer_ids() == []
            assert await used_blocks(decode) == 0 and len(decode._handoffs) == 0

    asyncio.run(scenario())


def test_abort_racing_a_local_request_into_the_engine_frees_it():
    async def scenario() -> None:
        async with running_workers() as (decode, _prefill):
            gate = threading.Event()
            decode._runtime.loop.call(gate.wait)  # the engine thread waits: calls queue
            aborting = asyncio.ensure_future(decode.abort("r"))
            await asyncio.sleep(0.1)  # abort() queued engine.abort (a no-op: nothing added yet)
            work = WorkRequest("r", PROMPT, SamplingParams(max_tokens=400, ignore_eos=True))
            generating = asyncio.ensure_future(decode.generate(work))
            await asyncio.sleep(0.1)  # generate() opened its stream and queued its request
            gate.set()
            await asyncio.gather(aborting, generating)
            assert await used_blocks(decode) == 0
            batches = await drain(decode, "r")
            assert [b.finish_reason for b in batches] == ["abort"]

    asyncio.run(scenario())
