"""The host tier (--kv-offload-gb): blocks the device pool evicts are kept in host memory and
brought back byte-identical; the tier never exceeds its budget; the union of the tiers stays
prefix-closed; KV events say which tier holds a block."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.core.block_hash import ROOT_HASH, prompt_block_hashes
from pdserve.core.sampling_params import SamplingParams
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.host_kv_pool import make_host_tier
from pdserve.engine.sequence import Sequence

BS = 4


def kv_pool(num_blocks: int, seed: int = 0) -> torch.Tensor:
    """A device pool stand-in on CPU: [layers, 2, blocks, block_size, heads, head_dim]."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(3, 2, num_blocks, BS, 2, 4, generator=gen)


def block_bytes(kv: torch.Tensor) -> int:
    return kv[:, :, 0].numel() * kv.element_size()


def tiered(num_blocks: int, host_blocks: int) -> tuple[BlockManager, torch.Tensor]:
    kv = kv_pool(num_blocks)
    tier = make_host_tier(kv, host_blocks * block_bytes(kv))
    return BlockManager(num_blocks, BS, host_tier=tier), kv


def seq(tokens: list[int], arrival: int = 0) -> Sequence:
    return Sequence(f"r{arrival}", list(tokens), len(tokens), SamplingParams(), arrival)


def compute(bm: BlockManager, kv: torch.Tensor, s: Sequence, seed: int) -> bool:
    """What a step does: blocks for every token, new KV written into the computed ones, then
    the full blocks enter the cache."""
    cached = bm.acquire_prefix(s, s.num_tokens - 1)
    if not bm.ensure_blocks(s, s.num_tokens):
        bm.release(s)
        return False
    gen = torch.Generator().manual_seed(seed)
    for block_id in s.block_table[cached // BS :]:
        kv[:, :, block_id] = torch.randn(kv[:, :, block_id].shape, generator=gen)
    s.num_computed_tokens = s.num_tokens
    bm.cache_full_blocks(s)
    return True


def test_evicted_blocks_come_back_byte_identical():
    bm, kv = tiered(num_blocks=4, host_blocks=8)
    a = seq(list(range(13)))  # 3 full blocks + 1 partial
    assert compute(bm, kv, a, seed=1)
    before = kv[:, :, a.block_table[:3]].clone()
    bm.release(a)
    bm.take_events()
    b = seq(list(range(100, 116)), 1)  # takes every block: a's are evicted to the host
    assert compute(bm, kv, b, seed=2)
    bm.release(b)
    events = bm.take_events()
    a_hashes = prompt_block_hashes(a.token_ids, BS)
    moved = [h for e in events if (e.kind, e.tier) == ("stored", "host") for h in e.block_hashes]
    assert sorted(moved) == sorted(a_hashes)
    assert not any(e.kind == "removed" for e in events)  # moved, not gone

    again = seq(list(range(13)), 2)
    assert bm.acquire_prefix(again, 12) == 12
    assert again.num_host_hit_tokens == 12
    # Byte for byte what was evicted, not merely close.
    after = kv[:, :, again.block_table]
    assert torch.equal(after.view(torch.int32), before.view(torch.int32))
    assert bm.host_tier.num_restored == 3
    events = bm.take_events()  # a's blocks back on the device; b's leave for the host
    back = [h for e in events if (e.kind, e.tier) == ("stored", "device") for h in e.block_hashes]
    assert back == a_hashes
    gone = [h for e in events if (e.kind, e.tier) == ("stored", "host") for h in e.block_hashes]
    assert len(gone) == 3 and not set(gone) & set(a_hashes)
    bm.check_invariants()
    bm.host_tier.check_invariants()


def test_a_block_is_in_one_tier_at_a_time():
    bm, kv = tiered(num_blocks=4, host_blocks=8)
    a = seq(list(range(9)))
    compute(bm, kv, a, 1)
    bm.release(a)
    compute(bm, kv, b := seq(list(range(50, 66)), 1), 2)  # a's blocks go to the host
    bm.release(b)
    assert len(bm.host_tier) == 4 + 2 - 4  # b's 4 blocks evicted a's 2; none of b's yet
    c = seq(list(range(9)), 2)
    compute(bm, kv, c, 3)  # restored: in the device cache, out of the host
    for h in prompt_block_hashes(c.token_ids, BS):
        assert bm.is_cached(h)
        assert not bm.host_tier.holds(h, tuple(c.token_ids[:BS]))


def test_without_room_on_the_device_the_walk_stops():
    bm, kv = tiered(num_blocks=3, host_blocks=8)
    a = seq(list(range(9)))
    compute(bm, kv, a, 1)
    bm.release(a)
    hog = seq(list(range(50, 62)), 1)  # holds every device block
    compute(bm, kv, hog, 2)
    again = seq(list(range(9)), 2)
    assert bm.acquire_prefix(again, 8) == 0
    bm.release(hog)
    assert bm.acquire_prefix(seq(list(range(9)), 3), 8) == 8


def test_budget_below_one_block_gives_no_tier():
    kv = kv_pool(4)
    assert make_host_tier(kv, block_bytes(kv) - 1) is None
    tier = make_host_tier(kv, 5 * block_bytes(kv) + 7)
    assert tier.num_slots == 5
    assert tier.copier.nbytes <= 5 * block_bytes(kv) + 7


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 5), st.integers(1, 6), st.booleans()), min_size=1, max_size=30
    ),
    st.integers(1, 6),
)
def test_host_tier_never_exceeds_its_budget_and_stays_prefix_closed(ops, host_blocks):
    """Random conversations (a family shares its first tokens) computed, held or released:
    the host never holds more than its slots, its pool never more bytes than its budget, and
    every held block's parent is held in one tier or the other."""
    bm, kv = tiered(num_blocks=6, host_blocks=host_blocks)
    budget = host_blocks * block_bytes(kv)
    held: list[Sequence] = []
    for i, (family, blocks, keep) in enumerate(ops):
        tokens = [family] * (BS * 2) + [1000 + i] * (BS * blocks - BS)
        s = seq(tokens[: BS * blocks + 1], i)
        if compute(bm, kv, s, i) and keep:
            held.append(s)
        else:
            bm.release(s)
        if len(held) > 1:
            bm.release(held.pop(0))
        tier = bm.host_tier
        assert len(tier) <= tier.num_slots == host_blocks
        assert tier.copier.nbytes <= budget
        tier.check_invariants()
        bm.check_invariants()
        for h, block in tier.index.items():
            parent = block.parent
            assert parent == ROOT_HASH or bm.is_cached(parent) or parent in tier.index, h
