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


def test_remembered_blocks_hash_as_fresh_ones_across_generations(monkeypatch) -> None:
    """The memo of recently hashed blocks answers only for the same (parent, tokens) input:
    prompts sharing a prefix, prompts that diverge, the same tokens under another parent, and
    entries that moved to the old generation and back all hash as block_hash does."""
    from pdserve.core import block_hash as module

    monkeypatch.setattr(module, "MEMO_BLOCKS", 8 * module.MEMO_SHARDS)  # 8 blocks a generation
    module.forget_hashed_blocks()
    rng = random.Random(1)
    system = [rng.randrange(50_000) for _ in range(64)]
    prompts = [system + [rng.randrange(50_000) for _ in range(rng.randrange(0, 80))]
               for _ in range(30)]  # fmt: skip
    prompts += [list(reversed(system)), system[16:] + system[:16], system * 2]
    for prompt in prompts + prompts[::-1]:  # the second pass hits old and young entries
        assert prompt_block_hashes(prompt, 16) == chained(prompt, 16)
    assert all(len(young) < 8 for young in module._young)
    assert all(len(old) <= 8 for old in module._old) and any(module._old)
    module.forget_hashed_blocks()
    assert not any(module._young) and not any(module._old)
