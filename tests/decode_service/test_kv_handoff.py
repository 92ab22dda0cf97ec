"""A prefill worker hands requests to a decode worker over the grpc transport; forged or
mismatched commits are refused without harming anything else the decode worker serves."""

from __future__ import annotations

import asyncio
import dataclasses
import math

import pytest
import torch

from kv_transfer import CommitInfo, KVTransferError, TransferRequest
from kv_transfer.grpc_sender import GrpcKVSender
from pdserve.core.messages import WorkRequest
from pdserve.core.sampling_params import SamplingParams
from pdserve.engine.engine import LLMEngine
from tests.decode_service.workers import ENGINE, KV, drain, running_workers, used_blocks
from tests.router.tls_certs import TestCA

PROMPT = list(range(10, 40))  # 7 full blocks of 4 and a partial one
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)


def colocated(prompt: list[int], params: SamplingParams) -> list[int]:
    return LLMEngine(dataclasses.replace(ENGINE)).generate([prompt], params)[0]


def tokens_of(batches) -> list[int]:
    return [t for batch in batches for t in batch.token_ids]


async def wait_idle(decode, timeout_s: float = 10.0) -> int:
    """Used blocks once the decode worker freed what it could (0 when nothing leaked)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while (used := await used_blocks(decode)) and loop.time() < deadline:
        await asyncio.sleep(0.05)
    return used


async def handoff(decode, prefill, request_id: str, prompt=PROMPT, params=GREEDY) -> list[int]:
    work = WorkRequest(request_id, prompt, params)
    reservation = await decode.reserve(work)
    # Two answers: the first token before the push (so it can go to the client at once),
    # then the same result once the KV is pushed and committed.
    answers = [
        (r.first_token_id, r.transfer_bytes) async for r in prefill.prefill(work, reservation)
    ]
    (first, before_push), (again, pushed) = answers
    assert first == again and before_push == 0 < pushed
    return [first] + tokens_of(await drain(decode, request_id))


def forged_send(decode, transfer_id: str, num_blocks: int, commit: CommitInfo) -> None:
    """Pushes KV of the right shape (zeros) with `commit`, as a holder of the secret could."""
    kv = decode._runtime.engine.kv_cache

    def read_kv(block_ids: list[int], l0: int, l1: int) -> torch.Tensor:
        return torch.zeros((l1 - l0, 2, len(block_ids), *kv.shape[3:]), dtype=kv.dtype)

    sender = GrpcKVSender(KV)
    try:
        sender.send(
            TransferRequest(
                decode._endpoint, transfer_id, list(range(num_blocks)), kv.shape[0], read_kv, commit
            )
        )
    finally:
        sender.close()


def test_handoff_decodes_like_the_colocated_engine():
    async def scenario() -> None:
        async with running_workers() as (decode, prefill):
            assert await handoff(decode, prefill, "a") == colocated(PROMPT, GREEDY)
            assert len(decode._handoffs) == 0  # the record ends with its commit
            assert await wait_idle(decode) == 0

    asyncio.run(scenario())


def test_a_decode_worker_with_async_scheduling_streams_the_colocated_tokens():
    """Handoffs decoding together on a decode worker whose steps overlap
    (engine/gpu_step/overlapped_steps.py): each request's tokens land a step later, the same
    ones."""
    prompts = [PROMPT, PROMPT[3:] + [7, 8], list(range(50, 71))]
    params = SamplingParams(max_tokens=12, ignore_eos=True)

    async def scenario() -> None:
        async with running_workers(decode_engine={"async_scheduling": True}) as workers:
            decode, prefill = workers
            got = await asyncio.gather(
                *(handoff(decode, prefill, f"r{i}", p, params) for i, p in enumerate(prompts))
            )
            assert got == [colocated(p, params) for p in prompts]
            assert await wait_idle(decode) == 0
            assert decode._runtime.engine.stats()["overlapped_steps"] > 0

    asyncio.run(scenario())


@pytest.mark.parametrize(
    ("field", "commit"),
    [
        ("first_token_id", dict(first_token_id=None)),  # None: the vocabulary size
        ("num_prompt_tokens", dict(num_prompt_tokens=len(PROMPT) + 1)),
        ("first_logprob", dict(first_logprob=math.nan)),
        ("first_logprob", dict(first_logprob=0.5)),
    ],
)
def test_commit_that_does_not_fit_the_reservation_is_refused(field, commit):
    async def scenario() -> None:
        async with running_workers() as (decode, _prefill):
            bystander = SamplingParams(max_tokens=40, ignore_eos=True)
            await decode.generate(WorkRequest("bystander", PROMPT[:9], bystander))
            work = WorkRequest("victim", PROMPT, SamplingParams(max_tokens=8, logprobs=True))
            reservation = await decode.reserve(work)
            vocab = decode._runtime.engine.model.config.vocab_size
            fields = dict(first_token_id=5, first_logprob=-0.1, num_prompt_tokens=len(PROMPT))
            fields.update(commit)
            if fields["first_token_id"] is None:
                fields["first_token_id"] = vocab
            blocks = len(reservation.missing_block_indices)
            with pytest.raises(KVTransferError, match=f"INVALID_ARGUMENT.*{field}"):
                await asyncio.to_thread(
                    forged_send, decode, reservation.transfer_id, blocks, CommitInfo(**fields)
                )
            # The victim's blocks are freed; the bystander decodes to its end, untouched.
            victim = await drain(decode, "victim")
            assert victim[-1].finish_reason == "abort" and tokens_of(victim) == []
            batches = await drain(decode, "bystander")
            assert batches[-1].finish_reason == "length"
            assert tokens_of(batches) == colocated(PROMPT[:9], bystander)
            assert await wait_idle(decode) == 0 and len(decode._handoffs) == 0

    asyncio.run(scenario())


@pytest.mark.parametrize("trusted", [False, True])
def test_received_kv_enters_the_prefix_cache_only_from_a_trusted_peer(trusted):
    async def scenario() -> None:
        async with running_workers(trust_peer_cache=trusted) as (decode, prefill):
            assert await handoff(decode, prefill, "a") == colocated(PROMPT, GREEDY)
            stats = await decode.stats()
            assert (stats.num_cached_blocks > 0) is trusted
            again = await decode.reserve(WorkRequest("b", PROMPT, GREEDY))
            assert (again.num_cached_tokens > 0) is trusted
            await decode.abort("b")

    asyncio.run(scenario())


def test_kv_received_over_mutual_tls_enters_the_prefix_cache(tmp_path):
    ca = TestCA(tmp_path)

    def tls(name: str, server: bool) -> dict:
        issued = ca.issue(name, server=server)
        return dict(tls_cert=str(issued.cert), tls_key=str(issued.key), tls_ca=str(ca.cert))

    async def scenario() -> None:
        workers = running_workers(
            decode_kv=tls("decode-0", server=True),
            prefill_kv=tls("prefill-0", server=False),
            advertise_host="127.0.0.1",  # the address the test certificate names
        )
        async with workers as (decode, prefill):
            assert await handoff(decode, prefill, "a") == colocated(PROMPT, GREEDY)
            assert (await decode.stats()).num_cached_blocks > 0

    asyncio.run(scenario())


def test_forged_kv_serves_only_its_own_request_by_default():
    async def scenario() -> None:
        async with running_workers() as (decode, prefill):
            work = WorkRequest("forged", PROMPT, GREEDY)
            reservation = await decode.reserve(work)
            blocks = len(reservation.missing_block_indices)
            commit = CommitInfo(first_token_id=5, num_prompt_tokens=len(PROMPT))
            await asyncio.to_thread(forged_send, decode, reservation.transfer_id, blocks, commit)
            await drain(decode, "forged")
            # A later client with the same prompt gets KV computed from it, not the forgery.
            assert await handoff(decode, prefill, "honest") == colocated(PROMPT, GREEDY)

    asyncio.run(scenario())
