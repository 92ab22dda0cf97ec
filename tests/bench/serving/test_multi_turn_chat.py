"""The multi-turn chat's least computed tokens, which `bench kv-tiers` and `bench peer-pull`
report their ways against."""

from __future__ import annotations

from pdserve.bench.serving.multi_turn_chat import minimum_prefill_tokens


def test_the_minimum_counts_blocks_once_in_order_and_a_fully_cached_prompt_as_one_token():
    block = 4
    first = list(range(8))  # two full blocks
    extended = first + [9, 9, 9, 9, 7]  # first's blocks cached, one new block, a tail of 1
    again = list(first)  # wholly cached: its last token runs again
    assert minimum_prefill_tokens([first, extended, again], block) == 8 + 4 + 1 + 1
    # Turn order: the earlier turn's last block is not cached yet when it runs.
    assert minimum_prefill_tokens([first, extended], block) == 8 + 5
