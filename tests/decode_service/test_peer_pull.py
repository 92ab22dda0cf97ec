"""Peer pull over the KV transports between two real decode workers: Y reserves the prompt and
pulls the prefix it lacks from X, which caches it. The tokens are those of one engine computing
everything, the pulled blocks are X's bytes, and a pull that X refuses, that never comes or
that stops midway falls back to prefilling on Y, with the same tokens, by the pull's deadline;
no block stays referenced on either worker."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator

import pytest
import torch

from decode_service.prefix_push import PrefixNotHeld
from decode_service.worker import DecodeWorker
from kv_transfer import KVTransferError, TransferRequest
from kv_transfer.grpc_sender import GrpcKVSender
from pdserve.core.messages import WorkRequest
from pdserve.core.sampling_params import SamplingParams
from tests.decode_service.test_kv_handoff import colocated, tokens_of, wait_idle
from tests.decode_service.workers import KV, drain, spec

PROMPT = list(range(10, 40))  # 7 full blocks of 4 and a partial one
HELD = 6  # X's cached blocks of PROMPT (an earlier turn of the conversation)
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=6, temperature=0.8, top_k=40, seed=5, ignore_eos=True)


@contextlib.asynccontextmanager
async def two_workers(**kv) -> AsyncIterator[tuple[DecodeWorker, DecodeWorker]]:
    """X, which has served an earlier turn of PROMPT, and Y, which has not."""
    x, y = DecodeWorker("x", spec(None, **kv)), DecodeWorker("y", spec(None, **kv))
    await asyncio.gather(x.ready(), y.ready())
    try:
        await x.generate(WorkRequest("turn-1", PROMPT[: HELD * 4] + [3], GREEDY))
        await drain(x, "turn-1")
        yield x, y
    finally:
        for worker in (x, y):
            worker._receiver.stop()
            if worker._sender is not None:
                worker._sender.close()
            await asyncio.to_thread(worker._runtime.shutdown)


async def pull(x, y, request_id: str, params=GREEDY, deadline_s: float = 20.0) -> list[int]:
    work = WorkRequest(request_id, PROMPT, params)
    reservation = await y.reserve_pull(work, HELD, deadline_s)
    first = reservation.num_cached_tokens // 4
    assert reservation.missing_block_indices == list(range(first, HELD))
    sent = await x.push_prefix(
        request_id,
        PROMPT[: HELD * 4],
        first,
        reservation.endpoint,
        reservation.transfer_id,
        time.time() + deadline_s,
    )
    assert sent > 0
    return tokens_of(await drain(y, request_id))


async def cached_kv(worker: DecodeWorker, token_ids: list[int]) -> torch.Tensor:
    """The KV of the cached full blocks of `token_ids` on `worker`."""
    engine = worker._runtime.engine

    def read() -> torch.Tensor:
        block_ids = engine.pin_prefix("read", token_ids)
        assert block_ids is not None
        try:
            return engine.read_kv(block_ids, 0, engine.num_layers)
        finally:
            engine.unpin_prefix("read")

    return await worker._runtime.loop.acall(read)


async def idle(*workers: DecodeWorker) -> list[int]:
    return [await wait_idle(worker) for worker in workers]


@pytest.mark.parametrize(
    ("transport", "params"),
    [("grpc", GREEDY), ("grpc", SEEDED), ("collective", GREEDY), ("nixl", SEEDED)],
    ids=["grpc-greedy", "grpc-seeded", "collective-greedy", "nixl-seeded"],
)
def test_pulled_prefix_generates_the_colocated_tokens(transport, params):
    async def scenario() -> None:
        async with two_workers(transport=transport, trust_peer_cache=True) as (x, y):
            assert await pull(x, y, "r", params) == colocated(PROMPT, params)
            # Y cached what it pulled (a trusted peer): byte for byte X's blocks.
            prefix = PROMPT[: HELD * 4]
            assert torch.equal(await cached_kv(y, prefix), await cached_kv(x, prefix))
            stats = await y.stats()
            assert stats.prefix_peer_hit_tokens == HELD * 4
            assert (stats.peer_pulls_started, stats.peer_pulls_committed) == (1, 1)
            assert stats.prefill_tokens == len(PROMPT) - HELD * 4
            assert stats.prefill_steps >= 1  # CostModel.step_seconds counts prompt steps
            assert await idle(x, y) == [0, 0] and len(y._handoffs) == 0

    asyncio.run(scenario())


def test_a_pull_past_the_pullers_own_hits_moves_only_the_rest():
    async def scenario() -> None:
        async with two_workers() as (x, y):
            await y.generate(WorkRequest("own", PROMPT[:9], GREEDY))  # Y caches 2 blocks
            await drain(y, "own")
            assert await pull(x, y, "r") == colocated(PROMPT, GREEDY)
            assert (await y.stats()).prefix_peer_hit_tokens == (HELD - 2) * 4
            assert await idle(x, y) == [0, 0]

    asyncio.run(scenario())


def test_a_holder_that_lost_the_prefix_refuses_and_the_puller_prefills():
    async def scenario() -> None:
        async with two_workers() as (x, y):
            work = WorkRequest("r", PROMPT, GREEDY)
            reservation = await y.reserve_pull(work, HELD + 1, 20.0)  # X never held block 7
            started = time.monotonic()
            with pytest.raises(PrefixNotHeld, match="no longer holds"):
                await x.push_prefix(
                    "r",
                    PROMPT[: (HELD + 1) * 4],
                    0,
                    reservation.endpoint,
                    reservation.transfer_id,
                    time.time() + 20,
                )
            # The refusal aborted Y's transfer: Y prefills at once, not at the deadline.
            assert tokens_of(await drain(y, "r")) == colocated(PROMPT, GREEDY)
            assert time.monotonic() - started < 10
            stats = await y.stats()
            assert (stats.peer_pulls_fallen_back, stats.prefix_peer_hit_tokens) == (1, 0)
            assert await idle(x, y) == [0, 0] and len(y._handoffs) == 0

    asyncio.run(scenario())


def test_a_peer_that_never_pushes_falls_back_by_the_deadline():
    async def scenario() -> None:
        async with two_workers() as (_x, y):
            started = time.monotonic()
            await y.reserve_pull(WorkRequest("r", PROMPT, SEEDED), HELD, 1.0)
            assert tokens_of(await drain(y, "r")) == colocated(PROMPT, SEEDED)
            assert 1.0 <= time.monotonic() - started < 8
            assert (await y.stats()).peer_pulls_fallen_back == 1
            assert await idle(y) == [0]

    asyncio.run(scenario())


def test_a_peer_that_dies_mid_pull_falls_back_and_its_late_chunks_are_fenced():
    """X's sender pushes the first layer, then stops as a killed process would (no commit, no
    abort); Y falls back at the deadline, and the chunks sent after it write nothing."""

    async def scenario() -> None:
        async with two_workers() as (x, y):
            reservation = await y.reserve_pull(WorkRequest("r", PROMPT, GREEDY), HELD, 1.5)
            engine = x._runtime.engine
            blocks = await x._runtime.loop.acall(lambda: engine.pin_prefix("p", PROMPT[:24]))
            resume, calls = threading.Event(), []

            def read_kv(block_ids: list[int], l0: int, l1: int) -> torch.Tensor:
                calls.append(l0)
                if len(calls) > 1:
                    resume.wait(30)  # the process is gone
                return engine.read_kv(block_ids, l0, l1)

            sender = GrpcKVSender(KV)
            request = TransferRequest(
                reservation.endpoint, reservation.transfer_id, blocks, engine.num_layers, read_kv,
                commit=None,
            )  # fmt: skip
            push = asyncio.create_task(asyncio.to_thread(sender.send, request))
            try:
                assert tokens_of(await drain(y, "r")) == colocated(PROMPT, GREEDY)
                resume.set()
                with pytest.raises(KVTransferError):
                    await push
            finally:
                resume.set()
                sender.close()
                await x._runtime.loop.acall(lambda: engine.unpin_prefix("p"))
            assert (await y.stats()).peer_pulls_fallen_back == 1
            assert await idle(x, y) == [0, 0] and len(y._handoffs) == 0

    asyncio.run(scenario())
