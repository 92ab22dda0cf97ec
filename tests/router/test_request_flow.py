"""RequestFlow in-process (tests/router/flow_cluster.py): a request streams its tokens, one token
per batch when asked, and every ending (done, client cancel, deadline, a failing engine step)
aborts it on every worker it touched."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from pdserve.core.messages import TokenBatch
from pdserve.core.sampling_params import SamplingParams
from router.errors import status_for
from router.types import NoWorkerAvailable, Progress
from tests.router.flow_cluster import (
    LETTERS,
    PROMPT,
    cluster,
    greedy,
    ids_of,
    run,
    script_after_prompt,
    text_of,
)
from tests.router.toy_workers import ToyDecodeWorker


@pytest.mark.parametrize("disaggregate", ["always", "never"])
def test_a_request_streams_its_tokens_and_is_aborted_on_its_workers_when_done(
    tokenizer, disaggregate
) -> None:
    async def scenario():
        c = await cluster(tokenizer, script_after_prompt(LETTERS), disaggregate=disaggregate)
        batches, progress = await c.generate(greedy(6))
        await c.pool.stop()
        return c, batches, progress

    c, batches, progress = run(scenario)
    assert ids_of(batches) == LETTERS[:6]
    assert text_of(batches) == "abcdef"
    assert batches[-1].finish_reason == "length" and progress.attempts == 1
    touched = ["decode-0"] + (["prefill-0"] if disaggregate == "always" else [])
    for worker_id in touched:
        worker = c.decode.get(worker_id) or c.prefill[worker_id]
        assert worker.aborted == ["req"]
    assert c.leaked_blocks() == {} and all(w.inflight == 0 for w in c.pool.workers.values())


def test_a_client_cancel_aborts_the_request_on_both_workers(tokenizer) -> None:
    async def scenario():
        c = await cluster(tokenizer, script_after_prompt(LETTERS))
        progress = Progress(received=time.perf_counter(), prompt_tokens=len(PROMPT))
        stream = c.flow.run("req", PROMPT, greedy(40), {}, progress)
        first = await anext(stream)
        await stream.aclose()  # what the gRPC server does when the client goes away
        await c.pool.stop()
        return c, first

    c, first = run(scenario)
    assert first.token_ids == [LETTERS[0]]
    assert c.prefill["prefill-0"].aborted == ["req"] and c.decode["decode-0"].aborted == ["req"]
    assert c.leaked_blocks() == {}


def test_a_deadline_aborts_the_request_on_both_workers(tokenizer) -> None:
    async def scenario():
        c = await cluster(tokenizer, script_after_prompt(LETTERS))
        c.decode["decode-0"].step_s = 0.02

        async def consume():
            await c.generate(greedy(1000, ignore_eos=True))

        with pytest.raises(TimeoutError):  # the RPC deadline cancels the handler's task
            await asyncio.wait_for(consume(), 0.3)
        await c.pool.stop()
        return c

    c = run(scenario)
    assert c.prefill["prefill-0"].aborted == ["req"] and c.decode["decode-0"].aborted == ["req"]
    assert c.leaked_blocks() == {}


@pytest.mark.parametrize("disaggregate", ["always", "never"])
def test_one_token_per_batch_splits_the_workers_batches_with_text_per_token(
    tokenizer, disaggregate
) -> None:
    """A decode worker sends 4 tokens a batch; asked for one token per batch, the client gets
    each token alone, its text decoded as far as it goes (the three byte tokens of "界" give
    "", "" and "界"), and a stop string inside a worker's batch still ends it at its token."""
    world = tokenizer.encode("界", add_special_tokens=False)
    end = tokenizer.encode("END", add_special_tokens=False)
    outputs = [LETTERS[0], *world, LETTERS[1], *end, LETTERS[2]]

    async def scenario(sampling: SamplingParams, one_token_per_batch: bool):
        c = await cluster(tokenizer, script_after_prompt(outputs), disaggregate=disaggregate)
        for worker in c.decode.values():
            worker.batch_tokens = 4
        progress = Progress(received=time.perf_counter(), prompt_tokens=len(PROMPT))
        run = c.flow.run("req", PROMPT, sampling, {}, progress, one_token_per_batch)
        batches = [b async for b in run]
        await c.pool.stop()
        return batches, progress

    whole, _ = run(lambda: scenario(greedy(5), one_token_per_batch=False))
    assert max(len(b.token_ids) for b in whole) == 4  # the worker's batches, as they came
    split, progress = run(lambda: scenario(greedy(5), one_token_per_batch=True))
    assert [b.token_ids for b in split] == [[t] for t in outputs[:5]]
    assert [b.text for b in split] == ["a", "", "", "界", "b"]
    assert [b.finished for b in split] == [False] * 4 + [True]
    assert split[-1].finish_reason == "length" and progress.completion_tokens == 5
    stopped, progress = run(lambda: scenario(greedy(9, stop=["END"]), one_token_per_batch=True))
    assert ids_of(stopped) == outputs[:8] and text_of(stopped) == "a界b"
    assert stopped[-1].finish_reason == "stop" and progress.completion_tokens == 8
    assert all(len(b.token_ids) == 1 for b in stopped)


class FailingStepDecodeWorker(ToyDecodeWorker):
    """A decode worker whose engine step fails on every request, as one whose CPU lacks the
    dtype's instructions: it ends each stream with an abort naming the step's error."""

    async def stream(self, request_id: str):
        await self._alive()
        yield TokenBatch(
            request_id, [], [], "", finished=True, finish_reason="abort",
            error="RuntimeError: mkldnn bf16 path needs avx512bw",
        )  # fmt: skip


def test_a_failing_engine_step_is_named_in_the_clients_status(tokenizer) -> None:
    async def scenario():
        c = await cluster(tokenizer, script_after_prompt(LETTERS), decode=1)
        worker = c.decode["decode-0"]
        worker.__class__ = FailingStepDecodeWorker
        with pytest.raises(NoWorkerAvailable) as failure:
            await c.generate(greedy(8))
        await c.pool.stop()
        return failure.value

    error = run(scenario)
    assert status_for(error)[0] == grpc.StatusCode.UNAVAILABLE
    assert str(error) == (
        "no healthy decode worker (decode-0: engine step failed: RuntimeError: mkldnn bf16 path "
        "needs avx512bw)"
    )
