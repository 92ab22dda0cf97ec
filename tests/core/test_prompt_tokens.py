"""PromptTokens: a prompt that remembers its block hashes, the same as hashing it each time."""

from __future__ import annotations

import copy
import pickle

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdserve.core.block_hash import prompt_block_hashes
from pdserve.core.prompt_tokens import PromptTokens, block_hashes_of, known_block_hashes

tokens = st.lists(st.integers(0, 2**32 - 1), max_size=70)


@given(tokens, st.integers(1, 17))
def test_hashes_are_prompt_block_hashes_computed_once(token_ids, block_size):
    prompt = PromptTokens(token_ids)
    assert prompt == token_ids
    first = prompt.block_hashes(block_size)
    assert list(first) == prompt_block_hashes(token_ids, block_size)
    assert prompt.block_hashes(block_size) is first  # remembered, not recomputed
    assert block_hashes_of(prompt, block_size) is first
    assert known_block_hashes(prompt, block_size) is first
    assert block_hashes_of(token_ids, block_size) == prompt_block_hashes(token_ids, block_size)
    assert known_block_hashes(token_ids, block_size) is None


def test_each_block_size_has_its_own_hashes():
    prompt = PromptTokens(range(12))
    assert list(prompt.block_hashes(4)) == prompt_block_hashes(list(range(12)), 4)
    assert list(prompt.block_hashes(3)) == prompt_block_hashes(list(range(12)), 3)
    assert len(prompt.block_hashes(4)) == 3 and len(prompt.block_hashes(3)) == 4


@pytest.mark.parametrize(
    "change",
    [
        lambda p: p.append(1),
        lambda p: p.extend([1]),
        lambda p: p.insert(0, 1),
        lambda p: p.pop(),
        lambda p: p.remove(0),
        lambda p: p.clear(),
        lambda p: p.sort(),
        lambda p: p.reverse(),
        lambda p: p.__setitem__(0, 5),
        lambda p: p.__delitem__(0),
        lambda p: p.__iadd__([1]),
        lambda p: p.__imul__(2),
    ],
)
def test_contents_cannot_change_so_hashes_cannot_go_stale(change):
    prompt = PromptTokens([0, 1, 2, 3])
    before = prompt.block_hashes(2)
    with pytest.raises(TypeError):
        change(prompt)
    assert prompt == [0, 1, 2, 3] and prompt.block_hashes(2) == before


def test_building_on_a_prompt_gives_a_plain_list_and_copies_stay_prompts():
    prompt = PromptTokens([5, 6, 7])
    longer = prompt + [8]
    assert longer == [5, 6, 7, 8] and type(longer) is list
    longer.append(9)  # a continuation's prompt grows freely
    for other in (copy.copy(prompt), copy.deepcopy(prompt), pickle.loads(pickle.dumps(prompt))):
        assert type(other) is PromptTokens and other == prompt
        assert other.block_hashes(2) == prompt.block_hashes(2)
