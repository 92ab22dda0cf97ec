"""The lookup answers what the engines' own prefix caches would hit.

Real block managers (the engines' prefix caches) under random traffic publish their KV events
through real publishers into a real redis-server; after every step, each worker's count in a
lookup must equal the leading blocks its cache holds. The traffic makes what breaks a bisecting
lookup when the cache is not prefix-closed: requests computing one new prefix at once (only
one copy registers), eviction under memory pressure, prompts diverging at every block.
"""

from __future__ import annotations

import random

from pdserve.core.block_hash import prompt_block_hashes
from pdserve.core.sampling_params import SamplingParams
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.sequence import Sequence
from pdserve.prefix_index.lookup import PrefixIndex
from pdserve.prefix_index.publisher import PrefixIndexPublisher

BS = 4
WORKERS = 3


def cached_run(bm: BlockManager, hashes: list[int]) -> int:
    held = [bm.is_cached(h) for h in hashes]
    return held.index(False) if False in held else len(held)


def random_prompt(rng: random.Random) -> list[int]:
    """A shared stem, then a branch at a random block, then a random tail: few token values,
    so prompts share and diverge at every depth."""
    stem = [1] * (BS * rng.randint(0, 6))
    return stem + [rng.randint(2, 3) for _ in range(BS * rng.randint(1, 6) + rng.randint(0, 3))]


def test_each_count_equals_the_workers_cached_prefix(redis_url: str) -> None:
    index = PrefixIndex(redis_url, "m", BS)
    for seed in range(12):
        rng = random.Random(seed)
        managers, publishers, running = [], [], []
        for w in range(WORKERS):
            managers.append(BlockManager(rng.randint(6, 24), BS))
            pub = PrefixIndexPublisher(redis_url, f"s{seed}w{w}", "m", BS, heartbeat_ttl_s=60)
            assert pub.register()
            publishers.append(pub)
            running.append([])
        for step in range(60):
            w = rng.randrange(WORKERS)
            bm, mine = managers[w], running[w]
            if mine and rng.random() < 0.45:  # a request ends
                bm.release(mine.pop(rng.randrange(len(mine))))
            else:  # a request arrives; a batch of them starts before any is cached
                # Often on one new prefix, as a burst of requests on a new system prompt.
                shared = [rng.randint(4, 99) for _ in range(BS * rng.randint(1, 3))]
                arrivals = [
                    (shared if rng.random() < 0.6 else []) + random_prompt(rng)
                    for _ in range(rng.randint(1, 3))
                ]
                started = []
                for tokens in arrivals:
                    s = Sequence(
                        f"{step}-{len(started)}", tokens, len(tokens), SamplingParams(), step
                    )
                    s.num_computed_tokens = bm.acquire_prefix(s, s.num_tokens - 1)
                    if bm.ensure_blocks(s, s.num_tokens):
                        started.append(s)
                    else:
                        bm.release(s)
                for s in started:  # computed together, then cached
                    s.num_computed_tokens = s.num_tokens
                    bm.cache_full_blocks(s)
                mine.extend(started)
            bm.check_invariants()
            assert publishers[w].publish(bm.take_events())
            # A running request's next turn (its whole history) or a new prompt.
            histories = [s.token_ids for seqs in running for s in seqs]
            turn = rng.choice(histories) + [3] * BS if histories and rng.random() < 0.7 else []
            probe = prompt_block_hashes(turn or random_prompt(rng), BS)
            expected = {}
            for i, other in enumerate(managers):
                if n := cached_run(other, probe):
                    expected[f"s{seed}w{i}"] = n
            assert index.lookup(probe) == expected, (seed, step)
        for pub in publishers:
            pub.unregister()
