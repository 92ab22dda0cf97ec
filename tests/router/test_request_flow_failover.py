"""RequestFlow in-process (tests/router/flow_cluster.py): a frozen decode worker is failed over,
before or during the push, and the first token reaches the client before the push."""

from __future__ import annotations

import asyncio
import time

from router.types import Progress
from tests.router.flow_cluster import (
    LETTERS,
    PROMPT,
    cluster,
    greedy,
    ids_of,
    run,
    script_after_prompt,
)


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
