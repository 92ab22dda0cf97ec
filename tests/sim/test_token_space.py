"""TokenSpace.nth, which sim_token maps its hash through: the index-th id of the vocabulary
that is not avoided, whether the avoided ids sit at the start, the end or in between."""

from __future__ import annotations

import random

import pytest

from pdserve.sim.tokens import TokenSpace, sim_token


@pytest.mark.parametrize("seed", range(40))
def test_nth_is_the_index_th_allowed_id(seed):
    rng = random.Random(seed)
    vocab = rng.randint(2, 80)
    avoid = set(rng.sample(range(vocab + 4), rng.randint(0, min(vocab - 1, 12))))
    space = TokenSpace(vocab, avoid)
    allowed = [t for t in range(vocab) if t not in avoid]
    assert space.size == len(allowed)
    assert [space.nth(i) for i in range(space.size)] == allowed


@pytest.mark.parametrize("avoid", [{0, 1}, {30, 31}, {10, 20}, set()])
def test_sim_tokens_are_allowed_ids_and_use_all_of_them(avoid):
    space = TokenSpace(32, avoid)
    seen = {sim_token([5, 6, 7], space, (seed, 0))[0] for seed in range(2000)}
    assert seen == set(range(32)) - avoid
