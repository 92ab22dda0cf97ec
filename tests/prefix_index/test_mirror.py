"""The router's copy of the prefix index (IndexMirror) against the Redis lookup, on a real
redis-server: every scenario's answer must be the Redis lookup's, once the mirror caught up."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import redis
from prometheus_client import REGISTRY

from pdserve.core.block_hash import prompt_block_hashes
from pdserve.core.kv_events import KVEvent
from pdserve.prefix_index import mirror as mirror_module
from pdserve.prefix_index.lookup import PrefixIndex
from pdserve.prefix_index.publisher import PrefixIndexPublisher
from pdserve.prefix_index.redis_server import RedisServer
from tests.prefix_index.heartbeats import LAPSING_TTL_S, wait_lapsed

BS = 4
HASHES = prompt_block_hashes(list(range(100, 100 + 48 * BS)), BS)  # 48 full blocks


def stored(hashes) -> KVEvent:
    return KVEvent("stored", list(hashes), len(hashes) * BS)


def removed(hashes) -> KVEvent:
    return KVEvent("removed", list(hashes), len(hashes) * BS)


def publisher(url: str, worker: str, ttl: float = 10.0) -> PrefixIndexPublisher:
    pub = PrefixIndexPublisher(url, worker, "m", BS, heartbeat_ttl_s=ttl)
    assert pub.register()
    return pub


@pytest.fixture
def indexes(redis_url: str) -> Iterator[tuple[PrefixIndex, PrefixIndex]]:
    """(the Redis lookup, the mirror), the mirror reading liveness every 0.1 s."""
    by_redis = PrefixIndex(redis_url, "m", BS)
    mirrored = PrefixIndex(redis_url, "m", BS, mirror=True)
    mirrored.mirror.liveness_s = 0.1
    yield by_redis, mirrored
    mirrored.close()
    by_redis.close()


@pytest.fixture(params=[False, True], ids=["whole", "yielding"])
def holds(request, monkeypatch) -> None:
    """Whether the reader offers the GIL back after every entry and every 3 hashes it sets or
    clears (a worker's reload in chunks), instead of rarely."""
    if request.param:
        monkeypatch.setattr(mirror_module, "HOLD_S", 0.0)
        monkeypatch.setattr(mirror_module, "HOLD_CHECK", 3)


def same_answer(indexes: tuple[PrefixIndex, PrefixIndex], hashes=HASHES) -> dict[str, int]:
    """Both answers, checked equal (the mirror's after it applied everything now in Redis)."""
    by_redis, mirrored = indexes
    assert mirrored.mirror.wait_caught_up()
    expected = by_redis.lookup(hashes)
    assert mirrored.mirror.lookup(hashes) == expected
    assert mirrored.lookup(hashes) == expected  # PrefixIndex answers from the mirror
    return expected


def test_the_mirror_answers_as_redis_through_stores_evictions_and_reorders(
    redis_url: str, holds, indexes
) -> None:
    workers = {f"w{i}": publisher(redis_url, f"w{i}") for i in range(12)}
    for pub in workers.values():
        pub.publish([stored(HASHES[:32])])
    assert same_answer(indexes) == {w: 32 for w in workers}
    workers["w3"].publish([removed(HASHES[31:9:-1])])  # evicted down to 10 blocks
    workers["w4"].publish([stored(HASHES[32:])])  # the whole prompt
    workers["w5"].publish([removed(HASHES[20:21]), stored(HASHES[20:21])])  # one batch, in order
    workers["w8"].publish([removed(HASHES[31:0:-1])])  # only the first block is left
    expected = {w: 32 for w in workers} | {"w3": 10, "w4": 48, "w8": 1}
    assert same_answer(indexes) == expected
    for n in (1, 2, 9, 10, 11, 33):  # shorter prompts, and every depth a worker stops at
        assert same_answer(indexes, HASHES[:n]) == {w: min(n, c) for w, c in expected.items()}
    other = prompt_block_hashes(list(range(100, 100 + 5 * BS)) + [7] * 8, BS)  # diverges at 5
    assert same_answer(indexes, other) == {w: min(5, c) for w, c in expected.items()}
    assert same_answer(indexes, []) == {}


def test_a_mirror_started_after_the_workers_builds_itself_from_redis(redis_url: str, holds) -> None:
    a, b = publisher(redis_url, "a"), publisher(redis_url, "b")
    a.publish([stored(HASHES)])
    b.publish([stored(HASHES[:7])])
    late = PrefixIndex(redis_url, "m", BS, mirror=True)
    try:
        assert late.mirror.wait_caught_up()
        assert late.mirror.lookup(HASHES) == {"a": 48, "b": 7}
        b.publish([removed(HASHES[6:7])])  # then follows the stream
        assert late.mirror.wait_caught_up()
        assert late.mirror.lookup(HASHES) == {"a": 48, "b": 6}
        assert late.mirror.builds == 1
    finally:
        late.close()


def test_restarts_fence_the_old_incarnation_and_unregistering_empties_the_worker(
    redis_url: str, holds, indexes
) -> None:
    old = publisher(redis_url, "a")
    old.publish([stored(HASHES)])
    assert same_answer(indexes) == {"a": 48}
    new = publisher(redis_url, "a")  # a new process: a new epoch, an empty cache
    assert same_answer(indexes) == {}
    new.publish([stored(HASHES[:2])])
    assert not old.heartbeat() and old.fenced  # the old process learns of the new epoch
    assert not old.publish([stored(HASHES)])
    assert same_answer(indexes) == {"a": 2}
    # An update of the old epoch that was already on its way counts for nothing.
    mirror = indexes[1].mirror
    applied = mirror.events
    fields = {"w": "a", "e": str(old.epoch), "op": "update", "q": 1, "r": "", "s": "1,2"}
    redis.Redis.from_url(redis_url).xadd(old.keys.events, fields)
    deadline = time.monotonic() + 5
    while mirror.events == applied and time.monotonic() < deadline:
        time.sleep(0.001)
    assert mirror.lookup(HASHES) == {"a": 2}  # at once, not only after liveness is read again
    assert same_answer(indexes) == {"a": 2}
    new.unregister()
    assert same_answer(indexes) == {}


def test_a_dead_worker_stops_counting_and_a_lapsed_one_comes_back(redis_url: str, indexes) -> None:
    dead = publisher(redis_url, "dead", ttl=LAPSING_TTL_S)
    live = publisher(redis_url, "live")
    dead.publish([stored(HASHES)])
    live.publish([stored(HASHES)])
    assert same_answer(indexes) == {"dead": 48, "live": 48}
    wait_lapsed(redis_url, dead)  # "dead" misses its heartbeats
    assert same_answer(indexes) == {"live": 48}
    assert dead.heartbeat()  # its key lapsed: it rewrites its entries (a reset event)
    assert same_answer(indexes) == {"dead": 48, "live": 48}


def test_updates_trimmed_away_unread_are_read_again_from_the_worker_set(
    redis_url: str, indexes
) -> None:
    """A reader that falls behind the stream's trimming sees a gap in a worker's update numbers
    and reads that worker's block set again; the others are untouched."""
    a, b = publisher(redis_url, "a"), publisher(redis_url, "b")
    a.publish([stored(HASHES[:4])])
    b.publish([stored(HASHES[:4])])
    assert same_answer(indexes) == {"a": 4, "b": 4}
    reloads = indexes[1].mirror.reloads
    # An update of a's whose stream entry was trimmed away before the reader came to it: its
    # entries are in Redis, its number is used, its event is gone.
    client = redis.Redis.from_url(redis_url)
    for h in HASHES[4:9]:
        client.hset(a.keys.block(h), "a", str(a.epoch))
    client.sadd(a.keys.worker_blocks("a"), *HASHES[4:9])
    a._published += 1
    a.publish([stored(HASHES[9:12])])
    b.publish([stored(HASHES[4:6])])
    assert same_answer(indexes) == {"a": 12, "b": 6}  # without the reload a would count 4
    assert indexes[1].mirror.reloads == reloads + 1  # a alone


def test_an_unreadable_stream_entry_rebuilds_the_copy_and_is_skipped(
    redis_url: str, indexes, monkeypatch
) -> None:
    """A writer of another version (or a bug) appends an entry the reader cannot parse: the
    copy is dropped and rebuilt from Redis rather than left stale with its reader dead."""
    monkeypatch.setattr(mirror_module, "RETRY_S", 0.05)
    a = publisher(redis_url, "a")
    a.publish([stored(HASHES[:3])])
    assert same_answer(indexes) == {"a": 3}
    mirror = indexes[1].mirror
    builds = mirror.builds
    redis.Redis.from_url(redis_url).xadd(a.keys.events, {"w": "a", "op": "update"})  # no epoch
    a.publish([stored(HASHES[3:5])])
    assert same_answer(indexes) == {"a": 5}
    assert mirror.builds == builds + 1 and mirror._thread.is_alive()


def metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_the_mirror_rebuilds_after_redis_restarts_and_answers_nothing_while_it_is_down(
    own_redis: RedisServer, monkeypatch
) -> None:
    monkeypatch.setattr(mirror_module, "RETRY_S", 0.05)
    url = own_redis.url
    a = publisher(url, "a")
    a.publish([stored(HASHES)])
    builds = metric("pdserve_index_mirror_reads_total", scope="build")
    index = PrefixIndex(url, "m", BS, mirror=True, socket_timeout_s=0.2)
    index.mirror.liveness_s = 0.1
    try:
        assert index.mirror.wait_caught_up()
        assert index.lookup(HASHES) == {"a": 48}
        assert metric("pdserve_index_mirror_up") == 1
        assert metric("pdserve_index_mirror_reads_total", scope="build") == builds + 1
        own_redis.restart()  # an empty Redis: the stream and every entry are gone
        deadline = time.monotonic() + 5
        while index.mirror.builds < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert index.mirror.builds == 2
        assert index.mirror.wait_caught_up() and index.lookup(HASHES) == {}
        assert a.heartbeat()  # the worker notices and rewrites its entries
        assert index.mirror.wait_caught_up() and index.lookup(HASHES) == {"a": 48}
        own_redis.stop()
        deadline = time.monotonic() + 5
        while index.mirror.ready and time.monotonic() < deadline:
            time.sleep(0.02)
        assert index.lookup(HASHES) == {}  # not ready, and Redis down: "unknown"
        assert metric("pdserve_index_mirror_up") == 0
        assert metric("pdserve_index_mirror_reads_total", scope="build") == builds + 2
    finally:
        index.close()


def test_liveness_must_be_shorter_than_the_read_timeout(redis_url: str) -> None:
    from pdserve.prefix_index.schema import IndexKeys

    with pytest.raises(ValueError, match="liveness_s"):
        mirror_module.IndexMirror(redis_url, IndexKeys("m"), liveness_s=3.0, socket_timeout_s=2.0)
