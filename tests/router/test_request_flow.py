"""RequestFlow in-process: the real router (WorkerPool, Routing, RoutingPolicy, RequestFlow) over
toy workers (tests/router/toy_workers.py) instead of Ray actors.

Retries continue after the tokens already sent (text, stop strings and seeded samples as in an
uninterrupted run), every ending aborts the request on every worker it touched, full KV pools
make a request wait and then RESOURCE_EXHAUSTED, and a frozen worker is failed over.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import grpc
import pytest

from pdserve.config import RouterConfig
from pdserve.core.messages import TokenBatch
from pdserve.core.sampling_params import SamplingParams
from pdserve.models.tokenizer_builder import write_tokenizer
from pdserve.tokenizer import Tokenizer
from router.errors import status_for
from router.policy import RoutingPolicy
from router.request_flow import RequestFlow
from router.routing import Routing
from router.types import NoWorkerAvailable, Overloaded, Progress
from router.worker_pool import WorkerPool
from tests.router.toy_workers import (
    BLOCK_SIZE,
    ToyDecodeWorker,
    ToyModel,
    ToyPrefillWorker,
)

VOCAB = 300
PROMPT = [10, 11, 12, 13, 14, 15]  # 6 tokens: one full block of 4 and a partial one
LETTERS = [67, 68, 69, 70, 71, 72, 73, 74]  # "abcdefgh"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    directory = tmp_path_factory.mktemp("tokenizer")
    write_tokenizer(directory, VOCAB)
    return Tokenizer.from_dir(directory)


def script_after_prompt(outputs: list[int]) -> list[int]:
    """A greedy script whose continuation of PROMPT is `outputs`, then letters."""
    return [0] * len(PROMPT) + outputs + LETTERS * 8


@dataclass
class Cluster:
    pool: WorkerPool
    flow: RequestFlow
    prefill: dict[str, ToyPrefillWorker]
    decode: dict[str, ToyDecodeWorker]
    routing: Routing

    @property
    def workers(self) -> list:
        return [*self.prefill.values(), *self.decode.values()]

    async def generate(self, sampling: SamplingParams, request_id: str = "req"):
        """(batches, progress) of one request, consumed to the end."""
        progress = Progress(received=time.perf_counter(), prompt_tokens=len(PROMPT))
        batches = [b async for b in self.flow.run(request_id, PROMPT, sampling, {}, progress)]
        return batches, progress

    def leaked_blocks(self) -> dict[str, int]:
        """Blocks still held by live workers (a dead worker's died with it)."""
        return {w.worker_id: w.used_blocks for w in self.workers if not w.dead and w.used_blocks}


async def cluster(
    tokenizer: Tokenizer,
    script: list[int],
    *,
    prefill: int = 1,
    decode: int = 2,
    disaggregate: str = "always",
    num_blocks: int = 1024,
    progress_timeout_s: float = 5.0,
    room_wait_s: float = 2.0,
    max_retries: int = 2,
    max_pending_requests: int = 256,
    on_prompt_computed=None,
    on_output_computed=None,
) -> Cluster:
    model = ToyModel(script, VOCAB)
    decoders = {
        f"decode-{i}": ToyDecodeWorker(f"decode-{i}", model, tokenizer, num_blocks=num_blocks)
        for i in range(decode)
    }
    prefillers = {
        f"prefill-{i}": ToyPrefillWorker(f"prefill-{i}", model, tokenizer, decode_workers=decoders)
        for i in range(prefill)
    }
    pool = WorkerPool(prefillers, decoders, poll_interval_s=0.02, call_timeout_s=1.0)
    await pool.start()
    # Round robin: the first attempt goes to decode-0, a retry to decode-1.
    config = RouterConfig(
        policy="round_robin",
        disaggregate=disaggregate,
        max_pending_requests=max_pending_requests,
    )
    routing = Routing(pool, RoutingPolicy(config), BLOCK_SIZE)
    flow = RequestFlow(
        pool,
        routing.choose_async,
        tokenizer,
        max_retries=max_retries,
        progress_timeout_s=progress_timeout_s,
        room_wait_s=room_wait_s,
        on_prefill_done=routing.on_prefill_done,
        on_prompt_computed=on_prompt_computed or routing.on_prompt_computed,
        on_output_computed=on_output_computed or routing.on_output_computed,
        block_size=BLOCK_SIZE,
    )
    routing.count(flow.waiting_for_room)
    return Cluster(pool, flow, prefillers, decoders, routing)


def run(scenario, timeout_s: float = 20.0):
    """Runs an async scenario; a hang fails the test instead of stalling the suite."""

    async def bounded():
        return await asyncio.wait_for(scenario(), timeout_s)

    return asyncio.run(bounded())


def ids_of(batches: list[TokenBatch]) -> list[int]:
    return [t for b in batches for t in b.token_ids]


def text_of(batches: list[TokenBatch]) -> str:
    return "".join(b.text for b in batches)


def greedy(max_tokens: int, **params) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, **params)


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


@pytest.mark.parametrize("disaggregate", ["always", "never"])
def test_a_retry_continues_after_the_tokens_already_sent(tokenizer, disaggregate) -> None:
    async def scenario():
        c = await cluster(tokenizer, script_after_prompt(LETTERS), disaggregate=disaggregate)
        c.decode["decode-0"].die_after_tokens = 3
        batches, progress = await c.generate(greedy(8))
        await c.pool.stop()
        return c, batches, progress

    c, batches, progress = run(scenario)
    assert ids_of(batches) == LETTERS  # nothing repeated, nothing missing
    assert text_of(batches) == "abcdefgh"
    assert progress.attempts == 2 and progress.decode_worker == "decode-1"
    assert c.decode["decode-1"].aborted == ["req#1"]
    assert c.leaked_blocks() == {}


def test_a_finished_request_names_the_tokens_its_last_decode_worker_computed(tokenizer) -> None:
    # The prompt and the output but its last token (never fed back), on the worker the retry
    # finished on: what a conversation's next turn finds cached there.
    computed = []

    async def scenario():
        c = await cluster(
            tokenizer,
            script_after_prompt(LETTERS),
            on_output_computed=lambda route, ids: computed.append((route.decode_worker, ids)),
        )
        c.decode["decode-0"].die_after_tokens = 3
        await c.generate(greedy(8))
        await c.pool.stop()

    run(scenario)
    assert computed == [("decode-1", PROMPT + LETTERS[:-1])]


def test_text_held_back_when_the_worker_died_is_sent_after_the_retry(tokenizer) -> None:
    # "界" is three byte tokens; decode-0 dies after sending two of them (its detokenizer held
    # them back as an incomplete character).
    world = tokenizer.encode("界", add_special_tokens=False)
    outputs = [LETTERS[0], world[0], world[1], world[2], LETTERS[1]]

    async def scenario():
        c = await cluster(tokenizer, script_after_prompt(outputs))
        c.decode["decode-0"].die_after_tokens = 2
        batches, progress = await c.generate(greedy(5))
        await c.pool.stop()
        return batches, progress

    batches, progress = run(scenario)
    assert progress.attempts == 2
    assert ids_of(batches) == outputs
    assert text_of(batches) == tokenizer.decode(outputs) == "a界b"


def test_a_stop_string_spanning_the_retry_boundary_stops_the_request(tokenizer) -> None:
    end = tokenizer.encode("END", add_special_tokens=False)
    outputs = [LETTERS[0], end[0], end[1], end[2], LETTERS[1], LETTERS[2]]

    async def scenario():
        c = await cluster(tokenizer, script_after_prompt(outputs))
        c.decode["decode-0"].die_after_tokens = 2  # after "EN", held back as a possible stop
        batches, progress = await c.generate(greedy(6, stop=["END"]))
        await c.pool.stop()
        return c, batches, progress

    c, batches, progress = run(scenario)
    assert progress.attempts == 2
    assert batches[-1].finished and batches[-1].finish_reason == "stop"
    assert text_of(batches) == "a"
    assert ids_of(batches) == outputs[:4]  # up to the token completing the stop string
    assert progress.completion_tokens == 4
    assert "req#1" in c.decode["decode-1"].aborted and c.leaked_blocks() == {}


def test_a_seeded_sampled_request_is_reproducible_across_a_retry(tokenizer) -> None:
    sampling = SamplingParams(max_tokens=10, temperature=1.0, seed=1234)

    async def scenario(die_after: int | None):
        c = await cluster(tokenizer, script_after_prompt(LETTERS))
        c.decode["decode-0"].die_after_tokens = die_after
        batches, progress = await c.generate(sampling)
        await c.pool.stop()
        return ids_of(batches), progress.attempts

    uninterrupted, attempts = run(lambda: scenario(None))
    assert attempts == 1
    retried, attempts = run(lambda: scenario(4))
    assert attempts == 2
    assert retried == uninterrupted


def test_cached_prompt_tokens_never_exceed_the_prompt_after_a_retry(tokenizer) -> None:
    # The retry's prompt is the client's prompt plus 7 generated tokens (13 tokens), and its
    # worker finds 12 of them cached; the client's prompt has 6.
    async def scenario():
        c = await cluster(tokenizer, script_after_prompt(LETTERS))
        c.decode["decode-0"].die_after_tokens = 6
        _, progress = await c.generate(greedy(8))
        await c.pool.stop()
        return progress

    progress = run(scenario)
    assert progress.attempts == 2
    assert progress.cached_tokens == len(PROMPT)


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


def test_when_every_attempt_fails_the_request_ends_unavailable_and_leaks_nothing(
    tokenizer,
) -> None:
    async def scenario():
        c = await cluster(tokenizer, script_after_prompt(LETTERS), decode=3)
        for worker in c.decode.values():
            worker.die_after_tokens = 1
        with pytest.raises(NoWorkerAvailable) as failure:
            await c.generate(greedy(8))
        await c.pool.stop()
        return c, failure.value

    c, error = run(scenario)
    assert status_for(error)[0] == grpc.StatusCode.UNAVAILABLE
    assert "after 3 attempts" in str(error)
    # The prefill worker heard an abort of every attempt it served.
    assert c.prefill["prefill-0"].aborted == ["req", "req#1", "req#2"]
    assert c.leaked_blocks() == {}


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
        deadline = time.monotonic() + 5
        while c.routing.pending() < 3 and time.monotonic() < deadline:
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


def test_a_frozen_decode_worker_is_failed_over_and_gets_no_new_requests(tokenizer) -> None:
    async def scenario():
        c = await cluster(tokenizer, script_after_prompt(LETTERS), progress_timeout_s=0.3)
        frozen = c.decode["decode-0"]
        frozen.freeze_after_tokens = 2
        started = time.monotonic()
        batches, progress = await c.generate(greedy(8))
        failover_s = time.monotonic() - started
        healthy_after = c.pool.workers["decode-0"].healthy
        # The next requests go elsewhere while decode-0 stays frozen.
        later = [await c.generate(greedy(2), request_id=f"later-{i}") for i in range(3)]
        frozen.thaw()
        await asyncio.sleep(0.05)  # the queued abort runs once it thaws
        await c.pool.stop()
        return c, batches, progress, failover_s, healthy_after, later

    c, batches, progress, failover_s, healthy_after, later = run(scenario)
    assert ids_of(batches) == LETTERS and progress.attempts == 2
    assert failover_s < 2.0
    assert not healthy_after
    assert all(p.decode_worker == "decode-1" and p.attempts == 1 for _, p in later)
    assert "req" in c.decode["decode-0"].aborted
    assert c.leaked_blocks() == {}


def test_a_decode_worker_frozen_during_the_push_is_failed_over(tokenizer) -> None:
    # The prefill worker keeps answering while its push into the frozen decode worker hangs:
    # the attempt still ends within the progress timeout, blamed on the decode worker.
    async def scenario():
        c = await cluster(tokenizer, script_after_prompt(LETTERS), progress_timeout_s=0.3)
        c.decode["decode-0"].freeze_after_reserving = True
        started = time.monotonic()
        batches, progress = await c.generate(greedy(8))
        failover_s = time.monotonic() - started
        healthy = {w: c.pool.workers[w].healthy for w in ("prefill-0", "decode-0")}
        c.decode["decode-0"].thaw()
        await asyncio.sleep(0.05)
        await c.pool.stop()
        return c, batches, progress, failover_s, healthy

    c, batches, progress, failover_s, healthy = run(scenario)
    assert ids_of(batches) == LETTERS and progress.attempts == 2
    assert progress.decode_worker == "decode-1"
    assert failover_s < 2.0
    assert healthy == {"prefill-0": True, "decode-0": False}


def test_the_first_token_reaches_the_client_before_the_push_and_a_failed_push_continues_it(
    tokenizer,
) -> None:
    # The prefill worker's first answer (the first token) is streamed at once, while its push
    # into the frozen decode worker hangs; the failed attempt's retry continues after it.
    computed = []  # when the router heard that a prefill worker's prompt was computed

    async def scenario():
        c = await cluster(
            tokenizer,
            script_after_prompt(LETTERS),
            progress_timeout_s=0.5,
            on_prompt_computed=lambda route: computed.append(time.perf_counter()),
        )
        c.decode["decode-0"].freeze_after_reserving = True
        progress = Progress(received=time.perf_counter(), prompt_tokens=len(PROMPT))
        arrivals = []
        async for batch in c.flow.run("req", PROMPT, greedy(8), {}, progress):
            arrivals.append((time.perf_counter(), batch))
        c.decode["decode-0"].thaw()
        await asyncio.sleep(0.05)
        await c.pool.stop()
        return c, arrivals, progress

    c, arrivals, progress = run(scenario)
    (first_at, first), (second_at, _) = arrivals[0], arrivals[1]
    assert first.token_ids == LETTERS[:1]
    # The router heard of the computed prompt with the first token, not after the push: the
    # prefill worker's queue no longer holds it (Routing.on_prompt_computed).
    assert computed and computed[0] <= first_at
    # The second token came only after the progress timeout failed the stalled push over.
    assert second_at - first_at >= 0.5 and progress.attempts == 2
    assert ids_of([b for _, b in arrivals]) == LETTERS
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
