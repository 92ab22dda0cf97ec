"""The router's memory of prefixes it just routed, before the Redis index can show them."""

from __future__ import annotations

from pdserve.core.block_hash import prompt_block_hashes
from router.recent_prefixes import RecentPrefixes, merge

HASHES = prompt_block_hashes(list(range(64)), 16)  # 4 chained blocks


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_routed_prefix_counts_for_its_worker_until_it_expires() -> None:
    clock = Clock()
    recent = RecentPrefixes(ttl_s=5.0, clock=clock)
    recent.add("p0", HASHES[:3])
    # Leading blocks only: a prompt that diverges after two blocks shares two.
    other = HASHES[:2] + prompt_block_hashes(list(range(100, 132)), 16)
    assert recent.lookup(HASHES, ["p0", "p1"]) == {"p0": 3}
    assert recent.lookup(other, ["p0"]) == {"p0": 2}
    clock.now = 4.0
    recent.add("p0", HASHES[:1])  # routed again: that block's memory is renewed
    clock.now = 6.0
    assert recent.lookup(HASHES, ["p0"]) == {"p0": 1}
    clock.now = 9.5
    assert recent.lookup(HASHES, ["p0"]) == {}


def test_a_restarted_worker_is_forgotten_and_memory_is_bounded() -> None:
    recent = RecentPrefixes(max_blocks=4)
    recent.add("p0", HASHES)
    recent.add("d0", HASHES)
    assert recent.lookup(HASHES, ["p0", "d0"]) == {"d0": 4}  # p0's older entries made room
    recent.forget("d0")
    assert recent.lookup(HASHES, ["p0", "d0"]) == {}


def test_views_merge_to_the_longest_prefix_per_worker() -> None:
    assert merge({"p0": 2, "p1": 5}, {"p0": 4}, {}) == {"p0": 4, "p1": 5}
