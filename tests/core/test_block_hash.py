"""prompt_block_hashes (the router's batched path) names blocks exactly as block_hash does."""

from __future__ import annotations

import random

from pdserve.core.block_hash import ROOT_HASH, block_hash, prompt_block_hashes


def chained(token_ids: list[int], block_size: int) -> list[int]:
    hashes, parent = [], ROOT_HASH
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = block_hash(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes


def test_prompt_hashes_chain_block_hash_over_full_blocks_only() -> None:
    rng = random.Random(0)
    for length in (0, 1, 15, 16, 17, 100, 4096, 4100):
        for block_size in (1, 4, 16, 17):
            prompt = [rng.randrange(1 << 32) for _ in range(length)]
            assert prompt_block_hashes(prompt, block_size) == chained(prompt, block_size)
            assert prompt_block_hashes(tuple(prompt), block_size) == chained(prompt, block_size)
    assert len(prompt_block_hashes(list(range(40)), 16)) == 2  # the partial tail has no hash
