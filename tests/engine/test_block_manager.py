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
    assert bm.num_evictable_blocks == 0  # both cached blocks are held
    bm.release(a)
    bm.release(b)
    assert bm.num_free_blocks == 8 and bm.num_cached_blocks == 2
    assert bm.num_evictable_blocks == 2  # free, but an allocation takes them by eviction
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


def test_reset_prefix_cache_frees_unheld_blocks_and_keeps_held_ones():
    bm = BlockManager(8, BS)
    done, running = seq([1] * 9), seq([2] * 9, 1)
    for s in (done, running):
        compute(bm, s)
    bm.release(done)
    bm.take_events()
    bm.reset_prefix_cache()
    assert [e.kind for e in bm.take_events()] == ["removed"]
    assert bm.acquire_prefix(seq([1] * 9, 2), 8) == 0  # the released prompt starts cold
    assert bm.acquire_prefix(seq([2] * 9, 3), 8) == 8  # a running one's blocks stay cached
    assert bm.num_free_blocks == 8 - len(running.block_table)
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
        assert bm.num_evictable_blocks == bm.num_cached_blocks - len(
            used & set(bm._cached.values())
        )
        for x in live.values():
            assert len(x.block_table) == -(-x.num_tokens // BS)
    for s in live.values():
        bm.release(s)
    bm.check_invariants()
    assert bm.num_free_blocks == num_blocks
    bm.take_events()


def test_a_fork_shares_every_block_and_copies_only_the_partial_last_one():
    bm = BlockManager(8, BS)
    parent = seq(list(range(10)))  # blocks: 4 + 4 full, 2 tokens in the last
    assert compute(bm, parent)
    child = seq(list(range(10)), 1)
    bm.fork(parent, child)
    child.num_computed_tokens = parent.num_computed_tokens
    assert child.block_table == parent.block_table
    assert [bm.ref_count(b) for b in parent.block_table] == [2, 2, 2]
    child.token_ids.append(7)
    assert bm.ensure_blocks(child, 11)
    copies = bm.copy_on_write(child, 10, 11)
    assert copies == [(parent.block_table[2], child.block_table[2])]
    assert child.block_table[:2] == parent.block_table[:2]  # full blocks stay shared
    parent.token_ids.append(8)
    assert bm.copy_on_write(parent, 10, 11) == []  # the last holder writes in place
    assert bm.num_used_blocks == 4
    bm.release(parent)
    assert [bm.ref_count(b) for b in child.block_table] == [1, 1, 1]
    bm.release(child)
    bm.check_invariants()
    assert bm.num_free_blocks == 8


def test_a_fork_at_a_block_boundary_copies_nothing():
    bm = BlockManager(8, BS)
    parent = seq(list(range(8)))
    assert compute(bm, parent)
    child = seq(list(range(8)), 1)
    bm.fork(parent, child)
    for s, token in ((parent, 1), (child, 2)):
        s.token_ids.append(token)
        assert bm.ensure_blocks(s, 9)
        assert bm.copy_on_write(s, 8, 9) == []
    assert parent.block_table[:2] == child.block_table[:2]
    assert parent.block_table[2] != child.block_table[2]


def test_copy_on_write_is_all_or_nothing():
    bm = BlockManager(3, BS)
    parent = seq([1, 2, 3, 4, 5, 6])
    assert compute(bm, parent)
    child = seq([1, 2, 3, 4, 5, 6], 1)
    bm.fork(parent, child)
    assert bm.ensure_blocks(child, 7)
    bm.ensure_blocks(seq([9], 2), 4)  # takes the last free block
    table = list(child.block_table)
    assert bm.copy_on_write(child, 0, 7) is None  # needs two copies, none is free
    assert child.block_table == table
    bm.check_invariants()


@settings(max_examples=200, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["add", "grow", "grow", "fork", "abort"]),
            st.integers(0, 5),  # which live sequence (modulo how many there are)
            st.lists(st.integers(0, 3), min_size=1, max_size=9),  # tokens (few values: hits)
        ),
        min_size=4,
        max_size=50,
    ),
    num_blocks=st.integers(1, 16),
)
def test_forks_copy_on_write_and_aborts_never_leak_or_double_free(ops, num_blocks):
    """Every sequence reads back exactly the tokens it wrote, through shared, copied and
    prefix-cached blocks: a write into a shared block would show up in another fork."""
    bm = BlockManager(num_blocks, BS)
    content: dict[int, dict[int, int]] = {}  # block -> slot -> token whose KV is there
    live: list[Sequence] = []

    def write(s: Sequence, start: int) -> bool:
        """A step over positions [start, num_tokens): blocks, copies, then the writes."""
        # The scheduler skips ensure_blocks and copy_on_write when `writable` says they
        # would change nothing: it must say so exactly then.
        writable, table = bm.writable(s, start, s.num_tokens), list(s.block_table)
        if not bm.ensure_blocks(s, s.num_tokens):
            assert not writable
            return False
        copies = bm.copy_on_write(s, start, s.num_tokens)
        assert writable == (copies == [] and s.block_table == table)
        if copies is None:
            return False
        for src, dst in copies:
            content[dst] = dict(content.get(src, {}))
        for p in range(start, s.num_tokens):
            content.setdefault(s.block_table[p // BS], {})[p % BS] = s.token_ids[p]
        s.num_computed_tokens = s.num_tokens
        bm.cache_full_blocks(s)
        return True

    for step, (op, which, tokens) in enumerate(ops):
        s = live[which % len(live)] if live else None
        if op == "add" or s is None:
            s = seq(tokens, step)
            s.num_computed_tokens = bm.acquire_prefix(s, s.num_tokens - 1)
            if write(s, s.num_computed_tokens):
                live.append(s)
            else:
                bm.release(s)
        elif op == "grow":
            start = s.num_tokens
            s.token_ids += tokens
            if not write(s, start):
                bm.release(s)  # preempted
                live.remove(s)
        elif op == "fork":
            child = seq(list(s.token_ids), step)
            bm.fork(s, child)
            child.num_computed_tokens = s.num_computed_tokens
            live.append(child)
        else:  # abort
            bm.release(s)
            live.remove(s)
        bm.check_invariants()
        used = {b for x in live for b in x.block_table}
        assert bm.num_used_blocks == len(used)
        for x in live:
            for b in set(x.block_table):
                assert bm.ref_count(b) == sum(y.block_table.count(b) for y in live)
            for p in range(x.num_computed_tokens):
                assert content[x.block_table[p // BS]][p % BS] == x.token_ids[p], (x, p)
    for s in live:
        bm.release(s)
    bm.check_invariants()
    assert bm.num_free_blocks == num_blocks


def test_truncate_frees_the_blocks_past_the_kept_tokens():
    bm = BlockManager(8, BS)
    a = seq(list(range(6)))
    assert compute(bm, a)  # one full cached block, one partial
    other = seq(list(range(6)), 1)
    bm.fork(a, other)
    assert bm.ensure_blocks(a, 15)  # room for drafts: 4 blocks
    drafted = a.block_table[2:]
    bm.truncate(a, 7)  # the drafts were rejected: 7 tokens need 2 blocks
    assert len(a.block_table) == 2
    assert all(bm.ref_count(b) == 0 for b in drafted)
    assert bm.num_free_blocks == 8 - 2
    bm.truncate(a, 9)  # never grows
    assert len(a.block_table) == 2
    bm.release(a)
    bm.release(other)
    assert bm.num_free_blocks == 8
    bm.check_invariants()


def cached_run(bm: BlockManager, tokens: list[int]) -> int:
    """Leading blocks of `tokens` in the cache, checked block by block (no acquiring)."""
    hashes = prompt_block_hashes(tokens, BS)
    held = [bm.is_cached(h) for h in hashes]
    return held.index(False) if False in held else len(held)


def test_a_prefix_computed_twice_at_once_leaves_no_gap_when_evicted():
    """Two requests on one new prefix compute it at once: the first registers it, the other
    keeps its copy unregistered and registers only what follows. When the registered copy is
    evicted while the other request runs, the blocks that extend it leave the cache with it:
    nothing can hit them, and the prefix index must never see a block without its parent."""
    bm = BlockManager(9, BS)
    first, second = seq([1] * 8 + [2] * 4), seq([1] * 8 + [3] * 4, 1)
    for s in (first, second):  # both allocate before either computes: no hit
        assert bm.ensure_blocks(s, s.num_tokens)
    for s in (first, second):
        s.num_computed_tokens = s.num_tokens
        bm.cache_full_blocks(s)
    assert bm.num_cached_blocks == 4  # [1]*4, [1]*4, then [2]*4 and [3]*4
    bm.release(first)
    bm.take_events()
    other = seq([5] * 24, 2)
    assert bm.ensure_blocks(other, 24)  # the 3 free blocks, then first's 3, tail first
    events = bm.take_events()
    second_tail = prompt_block_hashes(second.token_ids, BS)[2]
    removed = [h for e in events if e.kind == "removed" for h in e.block_hashes]
    first_hashes = prompt_block_hashes(first.token_ids, BS)
    # Leaves first: second's block before the block it extends.
    assert removed == [first_hashes[2], second_tail, first_hashes[1], first_hashes[0]]
    assert not bm.is_cached(second_tail)  # it extended the evicted prefix: gone too
    assert cached_run(bm, second.token_ids) == 0
    bm.check_invariants()
    bm.release(second)  # its blocks are unregistered: plain free space
    bm.check_invariants()
    assert bm.num_free_blocks == 3 and bm.num_cached_blocks == 0


def test_queued_prompt_tokens_count_a_cached_or_shared_prefix_once():
    # The router reads a worker's queue from this count: a queue of turns that share a cached
    # tenant prefix is short work, not several whole prompts (docs/benchmarks/routing.md).
    bm = BlockManager(16, BS)
    prefix = list(range(100, 108))  # two full blocks
    cached = seq(prefix + [1, 2])
    assert compute(bm, cached)
    bm.release(cached)
    cold = list(range(200, 208))
    waiting = [
        seq(prefix + [3, 4, 5], 1),  # its 2 cached blocks found: 3 tokens to compute
        seq(cold + [6], 2),  # nothing cached: 9 tokens
        seq(cold + [7, 8], 3),  # the 2 blocks the request ahead computes: 2 tokens
        seq(prefix, 4),  # wholly cached, but its last token is run: 1 token
    ]
    assert bm.queued_prompt_tokens(waiting) == 3 + 9 + 2 + 1
    assert BlockManager(16, BS, enable_prefix_caching=False).queued_prompt_tokens(waiting) == (
        sum(s.num_uncomputed_tokens for s in waiting)
    )


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=14), min_size=1, max_size=6),
    st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=14), min_size=1, max_size=6),
)
def test_queued_prompt_tokens_search_is_a_scan_of_each_prompt(computed, waiting):
    # The binary search relies on held blocks coming first along a prompt's chain (the cache
    # evicts descendants first; `ahead` holds whole prompts): the same as scanning block by
    # block, with evictions from a small pool in between.
    bm = BlockManager(6, BS)
    for i, tokens in enumerate(computed):
        s = seq(tokens, i)
        if compute(bm, s):
            bm.release(s)
    queue = [seq(tokens, 100 + i) for i, tokens in enumerate(waiting)]
    expected, ahead = 0, set()
    for s in queue:
        found = 0
        for h in bm.prompt_hashes(s):
            if not (bm.is_cached(h) or h in ahead):
                break
            found += 1
        expected += max(1, s.num_uncomputed_tokens - found * BS)
        ahead.update(bm.prompt_hashes(s))
    assert bm.queued_prompt_tokens(queue) == expected
