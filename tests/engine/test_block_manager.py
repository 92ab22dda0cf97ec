"""Block manager: reference counts, prefix cache with token checks, LRU eviction, KV events."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.core.block_hash import prompt_block_hashes
from pdserve.core.sampling_params import SamplingParams
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.sequence import Sequence

BS = 4


def seq(tokens: list[int], arrival: int = 0) -> Sequence:
    return Sequence(f"r{arrival}", list(tokens), len(tokens), SamplingParams(), arrival)


def compute(bm: BlockManager, s: Sequence) -> bool:
    """What a step does: blocks for every token, then the full ones enter the cache."""
    s.num_computed_tokens = bm.acquire_prefix(s, s.num_tokens - 1) if not s.block_table else 0
    if not bm.ensure_blocks(s, s.num_tokens):
        bm.release(s)
        return False
    s.num_computed_tokens = s.num_tokens
    bm.cache_full_blocks(s)
    return True


def test_hit_reuses_blocks_and_stores_are_reported():
    bm = BlockManager(8, BS)
    a = seq(list(range(10)))
    assert compute(bm, a)
    events = bm.take_events()
    assert [(e.kind, e.block_hashes, e.token_count) for e in events] == [
        ("stored", prompt_block_hashes(list(range(10)), BS), 2 * BS)
    ]
    b = seq(list(range(9)) + [99], 1)
    assert bm.acquire_prefix(b, b.num_tokens - 1) == 2 * BS
    assert b.block_table == a.block_table[:2]
    assert bm.ref_count(a.block_table[0]) == 2
    bm.release(a)
    bm.release(b)
    assert bm.num_free_blocks == 8 and bm.num_cached_blocks == 2
    bm.check_invariants()


def test_hit_checks_tokens_not_just_the_hash():
    bm = BlockManager(8, BS)
    a = seq([1, 2, 3, 4, 5])
    compute(bm, a)
    bm.release(a)
    # Simulate a hash collision: the cached block claims other tokens.
    block = next(iter(bm._cached.values()))
    bm._tokens[block] = (9, 9, 9, 9)
    assert bm.acquire_prefix(seq([1, 2, 3, 4, 5]), 4) == 0


def test_lru_eviction_emits_removed_and_keeps_recent_prefixes():
    bm = BlockManager(4, BS)
    old, recent = seq([1] * 8), seq([2] * 8, 1)
    for s in (old, recent):
        compute(bm, s)
        bm.release(s)
    bm.take_events()
    newcomer = seq([3] * 5, 2)
    assert bm.ensure_blocks(newcomer, 8)  # needs two of the four cached blocks
    events = bm.take_events()
    assert [e.kind for e in events] == ["removed"]
    assert set(events[0].block_hashes) == set(prompt_block_hashes([1] * 8, BS))
    assert bm.acquire_prefix(seq([2] * 9, 3), 8) == 8  # the recent prefix survived
    bm.check_invariants()


def test_allocation_is_all_or_nothing():
    bm = BlockManager(3, BS)
    s = seq([1] * 20)
    assert not bm.ensure_blocks(s, 20)
    assert s.block_table == [] and bm.num_free_blocks == 3


@settings(max_examples=150, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["add", "grow", "release"]),
            st.integers(0, 5),  # which sequence
            st.lists(st.integers(0, 3), min_size=1, max_size=14),  # tokens (few values: hits)
        ),
        max_size=40,
    ),
    num_blocks=st.integers(1, 12),
)
def test_blocks_are_never_both_free_and_used(ops, num_blocks):
    bm = BlockManager(num_blocks, BS)
    live: dict[int, Sequence] = {}
    for step, (op, key, tokens) in enumerate(ops):
        s = live.get(key)
        if op == "add" and s is None:
            s = seq(tokens, step)
            if compute(bm, s):
                live[key] = s
        elif op == "grow" and s is not None:
            s.token_ids += tokens
            if not bm.ensure_blocks(s, s.num_tokens):
                bm.release(s)  # preempted
                del live[key]
            else:
                s.num_computed_tokens = s.num_tokens
                bm.cache_full_blocks(s)
        elif op == "release" and s is not None:
            bm.release(s)
            del live[key]
        bm.check_invariants()
        used = {b for x in live.values() for b in x.block_table}
        assert bm.num_used_blocks == len(used)
        for x in live.values():
            assert len(x.block_table) == -(-x.num_tokens // BS)
    for s in live.values():
        bm.release(s)
    bm.check_invariants()
    assert bm.num_free_blocks == num_blocks
    bm.take_events()
