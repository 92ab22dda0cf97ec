"""RequestFlow in-process (tests/router/flow_cluster.py): a retry continues after the tokens
already sent (text, stop strings and seeded samples as in an uninterrupted run), and when every
attempt fails the request ends UNAVAILABLE and leaks nothing."""

from __future__ import annotations

import grpc
import pytest

from pdserve.core.sampling_params import SamplingParams
from router.errors import status_for
from router.types import NoWorkerAvailable
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
