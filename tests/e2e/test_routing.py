"""Prefix-aware routing in the served system: real Ray workers, the router's own redis-server.

Two prefill workers and one decode worker (every prompt is prefilled remotely, so the prefill
worker a request lands on is the routing decision under test). Heartbeats are short here so
that a dead worker's entries expire, and the index recovers from a Redis restart, in seconds.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator

import pytest

from pdserve.core.block_hash import prompt_block_hashes
from tests.e2e.conftest import ENGINE, serve_config
from tests.e2e.test_disaggregated_serving import (
    VOCAB_HIGH,
    VOCAB_LOW,
    collect,
    reference_outputs,
    request,
    run_concurrently,
)

HEARTBEAT_TTL_S = 1.5
SYSTEM_LEN = 40  # tokens of a shared system prompt: 10 full blocks of ENGINE.block_size
SYSTEM_BLOCKS = SYSTEM_LEN // ENGINE.block_size


@pytest.fixture(scope="module")
def served(ray_cluster) -> Iterator:
    from pdserve.app import BackgroundApp

    config = serve_config("grpc", prefill_workers=2, decode_workers=1)
    config.worker.prefix_heartbeat_ttl_s = HEARTBEAT_TTL_S
    # Cold groups on two idle workers are ties, drawn at random: unseeded, all four land on one
    # worker one run in eight. This seed's draws alternate, so the groups are shared.
    config.router.policy_seed = 2
    with BackgroundApp(config) as app:
        yield app


def eventually(check: Callable[[], object], timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while True:
        result = check()
        if result or time.monotonic() > deadline:
            return result
        time.sleep(0.1)


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(n)]


def group_prompts(rng: random.Random, num_groups: int, per_group: int) -> list[list[list[int]]]:
    """Groups of prompts, each a shared system prompt plus a short question of its own."""
    groups = []
    for _ in range(num_groups):
        system = tokens(rng, SYSTEM_LEN)
        groups.append([system + tokens(rng, rng.randint(1, 7)) for _ in range(per_group)])
    return groups


def holders(served, prompt: list[int]) -> dict[str, int]:
    """Live workers holding the prompt's system prompt, and how many of its blocks."""
    return served.app.routing.index.lookup(
        prompt_block_hashes(prompt[:SYSTEM_LEN], ENGINE.block_size)
    )


def test_requests_go_to_the_prefill_worker_holding_their_prefix(served, stub):
    groups = group_prompts(random.Random(21), num_groups=4, per_group=4)
    holder: dict[int, str] = {}
    outputs: dict[tuple[int, int], list[int]] = {}
    for g, prompts in enumerate(groups):  # one warm-up request per group, nothing cached yet
        outputs[g, 0], responses = collect(stub, request(prompts[0], 4))
        holder[g] = responses[-1].timings.prefill_worker
        assert eventually(lambda g=g: holders(served, groups[g][0]).get(holder[g]) == SYSTEM_BLOCKS)
    # Equal, idle workers share the cold groups; cached ones then pull their group back.
    assert set(holder.values()) == {"prefill-0", "prefill-1"}
    for i in range(1, 4):
        for g, prompts in enumerate(groups):  # interleaved, as concurrent users would be
            outputs[g, i], responses = collect(stub, request(prompts[i], 4))
            last = responses[-1]
            assert last.timings.prefill_worker == holder[g], (g, i)
            assert last.usage.cached_prompt_tokens >= SYSTEM_LEN
    order = sorted(outputs)
    expected = reference_outputs([groups[g][i] for g, i in order], [4] * len(order))
    assert [outputs[key] for key in order] == expected


def test_restarted_prefill_worker_loses_its_index_entries(served, stub):
    import ray

    prompts = group_prompts(random.Random(22), num_groups=1, per_group=4)[0]
    expected = reference_outputs(prompts, [5] * len(prompts))
    first, responses = collect(stub, request(prompts[0], 5))
    assert first == expected[0]
    victim = served.app.pool.workers[responses[-1].timings.prefill_worker]
    assert eventually(lambda: holders(served, prompts[0]).get(victim.worker_id) == SYSTEM_BLOCKS)
    old_epoch = victim.epoch

    ray.kill(victim.actor, no_restart=False)  # Ray restarts it (max_restarts=-1): a new epoch
    assert eventually(lambda: victim.healthy and victim.epoch != old_epoch, timeout_s=60)
    # The new incarnation registered a new epoch: the old one's blocks count no more.
    assert eventually(lambda: victim.worker_id not in holders(served, prompts[0]))
    results = run_concurrently(stub, prompts[1:], [5] * (len(prompts) - 1))
    assert [t for t, _ in results] == expected[1:]
    # Whoever computed the prefix again is in the index under its live epoch.
    assert eventually(lambda: SYSTEM_BLOCKS in holders(served, prompts[0]).values())


def test_requests_complete_through_a_redis_outage_and_the_index_recovers(served, stub):
    rng = random.Random(23)
    prompts = group_prompts(rng, num_groups=2, per_group=3)
    flat = [p for group in prompts for p in group] + [tokens(rng, 30) for _ in range(2)]
    max_tokens = [6] * len(flat)
    expected = reference_outputs(flat, max_tokens)
    redis_server, index = served.app.redis_server, served.app.routing.index

    redis_server.stop()
    try:
        results = run_concurrently(stub, flat, max_tokens)
        assert [t for t, _ in results] == expected
        assert holders(served, flat[0]) == {}  # unknown while Redis is down ...
        assert not index.available  # ... and routing knows it is
    finally:
        redis_server.restart()  # a fresh, empty server on the same port

    # Workers notice on their next heartbeat and rewrite what they hold; lookups work again.
    for group in prompts:
        assert eventually(lambda g=group: SYSTEM_BLOCKS in holders(served, g[0]).values())
    # Routing marks the index available again on its own next probe, which may come just
    # after the entries are back (a full CI run once looked in between).
    assert eventually(lambda: index.available)
    more = [group[0] + tokens(rng, 3) for group in prompts]
    results = run_concurrently(stub, more, [4] * len(more))
    assert [t for t, _ in results] == reference_outputs(more, [4] * len(more))


def test_killed_prefill_worker_entries_expire(served, stub):
    import ray

    prompts = group_prompts(random.Random(24), num_groups=1, per_group=3)[0]
    expected = reference_outputs(prompts, [5] * len(prompts))
    first, responses = collect(stub, request(prompts[0], 5))
    assert first == expected[0]
    victim = served.app.pool.workers[responses[-1].timings.prefill_worker]
    assert eventually(lambda: holders(served, prompts[0]).get(victim.worker_id) == SYSTEM_BLOCKS)

    # Gone for good (last test of the module): nothing unregisters it, its heartbeat expires.
    ray.kill(victim.actor, no_restart=True)
    assert eventually(
        lambda: victim.worker_id not in holders(served, prompts[0]), timeout_s=3 * HEARTBEAT_TTL_S
    )
    assert victim.worker_id not in served.app.routing.index.live_workers()
    results = run_concurrently(stub, prompts[1:], [5] * (len(prompts) - 1))
    assert [t for t, _ in results] == expected[1:]
    assert all(r[-1].timings.prefill_worker != victim.worker_id for _, r in results)
    # The router's garbage collection deletes the dead worker's entries from Redis itself.
    index, dead = served.app.routing.index, victim.worker_id
    system = prompt_block_hashes(prompts[0][:SYSTEM_LEN], ENGINE.block_size)
    assert eventually(
        lambda: (
            not index.link.client.exists(index.keys.worker_blocks(dead))
            and not any(index.link.client.hexists(index.keys.block(h), dead) for h in system)
        )
    )
