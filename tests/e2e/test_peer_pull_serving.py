"""Peer pull in the served system (--peer-pull): real Ray decode workers prefilling locally, the
round_robin policy sending a conversation's second turn to the worker that does not hold its
first. That worker pulls the prefix from the holder instead of recomputing it: the tokens are
the colocated engine's, its stats count the pulled tokens, and no block stays used."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest

from tests.e2e.conftest import ENGINE, serve_config
from tests.e2e.test_disaggregated_serving import (
    VOCAB_HIGH,
    VOCAB_LOW,
    all_workers_idle,
    collect,
    reference_outputs,
    request,
)

FIRST_TURN = 120  # tokens: 30 full blocks of ENGINE.block_size


@pytest.fixture(scope="module")
def served(ray_cluster) -> Iterator:
    from pdserve.app import BackgroundApp

    config = serve_config("grpc", prefill_workers=0, decode_workers=2)
    config.router.disaggregate = "never"
    config.router.policy = "round_robin"  # the second turn lands on the other worker
    config.router.peer_pull = True
    with BackgroundApp(config) as app:
        yield app


def stats_of(served) -> dict:
    import ray

    return {w.worker_id: ray.get(w.actor.stats.remote()) for w in served.app.pool.workers.values()}


def test_a_second_turn_on_the_other_worker_pulls_the_first_turns_prefix(served, stub):
    rng = random.Random(5)
    first = [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(FIRST_TURN)]
    (reply,) = reference_outputs([first], [6])
    second = first + reply + [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(7)]
    (expected,) = reference_outputs([second], [8])

    got_first, responses = collect(stub, request(first, 6))
    assert got_first == reply
    holder = responses[-1].timings.decode_worker
    got, responses = collect(stub, request(second, 8))
    assert got == expected
    puller = responses[-1].timings.decode_worker
    assert puller != holder
    stats = stats_of(served)
    pulled = stats[puller].prefix_peer_hit_tokens
    # The holder caches the first turn's prompt and all but its last output token.
    assert pulled == (FIRST_TURN + len(reply) - 1) // ENGINE.block_size * ENGINE.block_size
    assert (stats[puller].peer_pulls_started, stats[puller].peer_pulls_committed) == (1, 1)
    assert stats[puller].peer_pulls_fallen_back == 0
    assert responses[-1].usage.cached_prompt_tokens == pulled
    assert all_workers_idle(served) == {holder: 0, puller: 0}
