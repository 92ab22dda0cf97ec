"""The router's memory of prefixes it just routed, before the Redis index can show them."""

from __future__ import annotations

from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.core.block_hash import prompt_block_hashes
from router import recent_prefixes
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


def test_remembered_blocks_count_each_block_sent_to_a_worker_once() -> None:
    clock = Clock()
    recent = RecentPrefixes(ttl_s=5.0, clock=clock)
    recent.add("p0", HASHES[:3])
    recent.add("p0", HASHES)  # a longer prompt of the same prefix: one more block
    recent.add("p1", HASHES[:2])
    assert (recent.remembered_blocks("p0"), recent.remembered_blocks("p1")) == (4, 2)
    assert recent.remembered_blocks("p2") == 0
    clock.now = 4.0
    recent.add("p0", HASHES[:1])
    clock.now = 6.0  # the first three routes expired; the renewed block counts
    assert recent.remembered_blocks("p0") == 1


def test_a_restarted_worker_is_forgotten_and_memory_is_bounded() -> None:
    recent = RecentPrefixes(max_blocks=4)
    recent.add("p0", HASHES)
    recent.add("d0", HASHES)
    assert recent.lookup(HASHES, ["p0", "d0"]) == {"d0": 4}  # p0's older entries made room
    recent.forget("d0")
    assert recent.lookup(HASHES, ["p0", "d0"]) == {}


def test_forgotten_routes_leave_no_tables_behind() -> None:
    """Entries of forgotten routes are not deleted one by one, yet memory stays bounded by what
    is remembered: a worker's table is rebuilt without them, and a worker nothing is remembered
    of, or a first block no remembered route starts with, is dropped."""
    recent = RecentPrefixes(max_blocks=64)
    for i in range(3000):  # distinct prompts of 8 blocks to 3 workers, always at the cap
        recent.add(f"w{i % 3}", prompt_block_hashes([i] * 128, 16))
    assert recent._routed_blocks <= 64
    assert len(recent._first) <= 8  # one per remembered route
    for held in recent._held.values():
        assert len(held.serials) <= 2 * held.routed_blocks + recent_prefixes.SLACK
    recent = RecentPrefixes(ttl_s=1.0, clock=(clock := Clock()))
    recent.add("w0", HASHES)
    clock.now = 2.0
    assert recent.lookup(HASHES, ["w0"]) == {}  # expired: and its tables are gone
    assert not recent._held and not recent._first


def test_views_merge_to_the_longest_prefix_per_worker() -> None:
    assert merge({"p0": 2, "p1": 5}, {"p0": 4}, {}) == {"p0": 4, "p1": 5}


@pytest.mark.parametrize("slack", [recent_prefixes.SLACK, -(1 << 30)])  # < 0: rebuilt at every add
@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["add", "add", "lookup", "forget", "tick"]),
            st.sampled_from(["w0", "w1", "w2"]),
            st.integers(0, 3),  # which chain
            st.integers(0, 6),  # how many of its blocks
        ),
        min_size=8,
        max_size=40,
    ),
    st.integers(3, 40),
)
def test_lookup_answers_what_the_remembered_routes_hold(slack, steps, max_blocks) -> None:
    """Against a model kept as the list of routes themselves: a worker holds a block while a
    route that sent it there is remembered (not expired, not dropped for room, not before a
    restart); routes are dropped oldest first while they hold more than `max_blocks` blocks."""
    chains = [prompt_block_hashes([c % 2] * 16 + [c] * 80, 16) for c in range(4)]  # shared heads
    clock = Clock()
    recent = RecentPrefixes(ttl_s=5.0, max_blocks=max_blocks, clock=clock)
    routes: list[list] = []  # [worker, hashes, expiry, still valid (no restart since)]

    def held() -> set[tuple[str, int]]:
        return {(w, h) for w, hashes, _, valid in routes if valid for h in hashes}

    with mock.patch.object(recent_prefixes, "SLACK", slack):
        for action, worker, chain, blocks in steps:
            hashes = chains[chain][:blocks]
            if action == "add":
                recent.add(worker, hashes)
                routes.append([worker, hashes, clock.now + 5.0, True])
                while sum(len(r[1]) for r in routes) > max_blocks:
                    routes.pop(0)
            elif action == "forget":
                recent.forget(worker)
                for route in routes:
                    route[3] = route[3] and route[0] != worker
            elif action == "tick":
                clock.now += 3.0  # a route added before the last tick is still remembered
            else:
                while routes and routes[0][2] <= clock.now:
                    routes.pop(0)
                pairs, expected = held(), {}
                for w in ("w0", "w2"):
                    count = 0
                    while count < len(hashes) and (w, hashes[count]) in pairs:
                        count += 1
                    if count:
                        expected[w] = count
                assert recent.lookup(hashes, ["w0", "w2"]) == expected
                for w in ("w0", "w1", "w2"):  # the distinct blocks each worker was sent
                    assert recent.remembered_blocks(w) == sum(1 for v, _ in pairs if v == w)
