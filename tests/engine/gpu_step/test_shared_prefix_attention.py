"""Shared-prefix attention: decode sequences that fork a prefix's blocks attend as one
pseudo-sequence per family, with the same result as each attending over its own table."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pdserve.engine.gpu_step.attention_batch import (
    MIN_SHARED_BLOCKS,
    SHARED_TO_OWN_BLOCKS,
    attention_context,
    shared_prefix_families,
)
from pdserve.models.attention import paged_attention

BLOCK_SIZE, KV_HEADS, HEADS, HEAD_DIM, NUM_BLOCKS = 4, 2, 4, 8, 256


def _forked_step(families, loners, gen):
    """A decode step: each family is (prefix tokens, [each member's tokens past the prefix,
    counting its new one]); members share the prefix's full blocks and own the rest (the
    partly filled last prefix block copied on write, as the block manager does). `loners`:
    lengths of unrelated sequences. Returns starts, lens, tables, slots."""
    free = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
    starts, tables, slots = [], [], []

    def take(n):
        nonlocal free
        got, free = free[:n], free[n:]
        return got

    def add(table, length):
        tables.append(table)
        starts.append(length - 1)
        last = length - 1
        slots.append(table[last // BLOCK_SIZE] * BLOCK_SIZE + last % BLOCK_SIZE)

    for prefix, tails in families:
        shared = take(prefix // BLOCK_SIZE)  # full prefix blocks: shared
        for tail in tails:
            length = prefix + tail
            add(shared + take(-(-length // BLOCK_SIZE) - len(shared)), length)
    for length in loners:
        add(take(-(-length // BLOCK_SIZE)), length)
    return starts, [1] * len(starts), tables, slots


def _attend(starts, lens, tables, slots, gen, **replace):
    tokens = sum(lens)
    q = torch.randn(tokens, HEADS, HEAD_DIM, generator=gen)
    k = torch.randn(tokens, KV_HEADS, HEAD_DIM, generator=gen)
    v = torch.randn(tokens, KV_HEADS, HEAD_DIM, generator=gen)
    cache = torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=gen)
    ctx = attention_context(starts, lens, tables, slots, BLOCK_SIZE, torch.device("cpu"))
    plain = dataclasses.replace(ctx, groups=None)  # every sequence over its own table
    return (
        ctx,
        paged_attention(q, k, v, cache.clone(), ctx),
        paged_attention(q, k, v, cache.clone(), plain),
    )


@pytest.mark.parametrize(
    ("families", "loners"),
    [
        # 4 beams of a 30-token prompt (partial last block), 1..9 tokens generated each
        ([(30, [1, 5, 9, 2])], []),
        # two requests' beams of different prompts and lengths, beside unrelated sequences
        ([(64, [3, 3, 7, 1]), (21, [2, 11])], [5, 40, 17]),
        # n choices of a prompt ending on a block boundary
        ([(32, [1, 1, 1])], [33]),
        # families of different widths: two pseudo-sequence groups
        ([(40, [1, 2]), (200, [1, 4, 6, 3])], [2, 3]),
    ],
)
def test_shared_prefix_attention_equals_per_sequence_attention(families, loners):
    gen = torch.Generator().manual_seed(len(loners) + len(families))
    starts, lens, tables, slots = _forked_step(families, loners, gen)
    ctx, grouped, expected = _attend(starts, lens, tables, slots, gen)
    # The families were found: some group holds several queries per pseudo-sequence.
    assert ctx.groups is not None
    assert any(g.query_index.shape[1] > 1 for g in ctx.groups)
    torch.testing.assert_close(grouped, expected)


def test_families_are_sequences_sharing_their_first_blocks():
    prefix = list(range(10, 10 + MIN_SHARED_BLOCKS))
    tables = [prefix + [1], prefix + [2, 3], [5, 6], prefix + [4], [7] + prefix[1:]]
    num_blocks = [len(t) for t in tables]
    found = shared_prefix_families(list(range(5)), tables, num_blocks)
    assert found == [([0, 1, 3], MIN_SHARED_BLOCKS)]
    # Only the blocks a sequence attends over count: here member 3 shortens what all share.
    num_blocks[3] = MIN_SHARED_BLOCKS - 1
    assert shared_prefix_families(list(range(5)), tables, num_blocks) == []
    # Too few shared blocks, or too few beside a member's own: attended apart.
    short = [prefix[: MIN_SHARED_BLOCKS - 1] + [100 + i] for i in range(3)]
    assert shared_prefix_families([0, 1, 2], short, [MIN_SHARED_BLOCKS] * 3) == []
    own = SHARED_TO_OWN_BLOCKS * MIN_SHARED_BLOCKS  # more own blocks than the bound allows
    long_tail = [prefix + [200], prefix + list(range(300, 300 + own))]
    assert shared_prefix_families([0, 1], long_tail, [len(t) for t in long_tail]) == []


def test_a_family_gathers_its_shared_blocks_once():
    gen = torch.Generator().manual_seed(3)
    starts, lens, tables, slots = _forked_step([(160, [1, 2, 3, 4])], [], gen)
    ctx = attention_context(starts, lens, tables, slots, BLOCK_SIZE, torch.device("cpu"))
    (group,) = ctx.groups
    per_sequence = sum(len(t) for t in tables)
    assert group.block_tables.numel() == 160 // BLOCK_SIZE + 4
    assert per_sequence == 4 * (160 // BLOCK_SIZE + 1)
