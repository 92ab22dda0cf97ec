"""Decode attention in groups of similar context length: the same result as one padded batch."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pdserve.engine.gpu_step.attention_batch import attention_context
from pdserve.models.attention import MIN_SPARED_BLOCKS, length_groups, paged_attention


def test_uniform_or_close_lengths_stay_one_group():
    assert length_groups([4] * 32) == [list(range(32))]
    assert length_groups([10, 9, 8, 10]) == [[0, 3, 1, 2]]


def test_a_cut_needs_enough_spared_padding():
    # Padding the 3 short ones to 30 blocks costs 3 * 28 blocks: cut.
    assert length_groups([2, 30, 2, 2]) == [[1], [0, 2, 3]]
    # One short sequence 10 blocks under the longest spares fewer than MIN_SPARED_BLOCKS.
    assert MIN_SPARED_BLOCKS > 10
    assert length_groups([12, 2]) == [[0, 1]]


def test_every_sequence_is_in_exactly_one_group():
    lengths = torch.randint(1, 60, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    groups = length_groups(lengths)
    assert sorted(i for g in groups for i in g) == list(range(40))
    assert len(groups) > 1


@pytest.mark.parametrize(
    ("lasts", "lens"),
    [
        ([1, 40, 2, 37], [1, 1, 1, 1]),  # decode: short and long contexts
        ([1, 30, 2, 20], [1, 1, 1, 6]),  # decode rows beside a prefill chunk
        ([0, 3, 40, 44], [3, 1, 5, 1]),  # two chunks, two decode rows
    ],
)
def test_grouped_attention_equals_the_padded_batch(lasts, lens):
    """`lasts`: each sequence's last new position; `lens`: its new tokens."""
    cache, starts, tables, slots, block_size, (q, k, v) = random_step(lasts, lens)
    grouped = attention_context(starts, lens, tables, slots, block_size, torch.device("cpu"))
    assert grouped.groups is not None and len(grouped.groups) >= 2
    whole = dataclasses.replace(grouped, groups=None)
    expected = paged_attention(q, k, v, cache.clone(), whole)
    torch.testing.assert_close(paged_attention(q, k, v, cache.clone(), grouped), expected)


def random_step(lasts: list[int], lens: list[int]):
    """A step over a random cache (block size 4, 4 query and 2 KV heads of 8): `lasts` each
    sequence's last new position, `lens` its new tokens. Returns the cache, each sequence's
    first new position, block tables, slots, the block size and the new tokens' q, k, v."""
    gen = torch.Generator().manual_seed(1)
    block_size, kv_heads, heads, head_dim, num_blocks = 4, 2, 4, 8, 64
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen)
    blocks = torch.randperm(num_blocks, generator=gen).tolist()
    starts = [last - n + 1 for last, n in zip(lasts, lens, strict=True)]
    tables, slots = [], []
    for last, start in zip(lasts, starts, strict=True):
        table, blocks = blocks[: last // block_size + 1], blocks[last // block_size + 1 :]
        tables.append(table)
        slots += [
            table[p // block_size] * block_size + p % block_size for p in range(start, last + 1)
        ]
    tokens = sum(lens)
    qkv = [torch.randn(tokens, h, head_dim, generator=gen) for h in (heads, kv_heads, kv_heads)]
    return cache, starts, tables, slots, block_size, qkv
