"""Garbage collection of the prefix index against a real redis-server: dead workers' entries go,
live workers' stay, each round's cost is bounded, and the router's thread runs it unasked."""

from __future__ import annotations

import time

import redis

from pdserve.core.block_hash import prompt_block_hashes
from pdserve.core.kv_events import KVEvent
from pdserve.prefix_index.lookup import PrefixIndex
from pdserve.prefix_index.maintenance import IndexMaintenance
from pdserve.prefix_index.publisher import PrefixIndexPublisher
from pdserve.prefix_index.sweeper import IndexSweeper, SweepRound

BS = 4
HASHES = prompt_block_hashes(list(range(100, 132)), BS)  # 8 blocks


def publisher(url: str, worker: str, ttl: float, model: str = "m") -> PrefixIndexPublisher:
    pub = PrefixIndexPublisher(url, worker, model, BS, heartbeat_ttl_s=ttl)
    assert pub.register()
    return pub


def keys_of(client: redis.Redis, model: str = "m") -> set[str]:
    """The index's keys, less its event stream: a log bounded by its length (schema.py), which
    holds no entry of its own for the sweeper to remove."""
    return set(client.keys(f"pdserve:{{{model}}}:*")) - {f"pdserve:{{{model}}}:events"}


def eventually(check, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_dead_worker_keys_are_deleted_and_live_ones_stay(redis_url: str) -> None:
    dead, live = publisher(redis_url, "dead", ttl=1.0), publisher(redis_url, "live", ttl=10)
    dead.publish([KVEvent("stored", HASHES, 8 * BS)])
    live.publish([KVEvent("stored", HASHES[:3], 3 * BS)])
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    index = PrefixIndex(redis_url, "m", BS)
    sweeper = IndexSweeper(index)
    assert sweeper.sweep() == SweepRound(pass_complete=True)  # nothing to remove yet
    assert client.exists(dead.keys.block(HASHES[7]))

    time.sleep(1.1)  # the dead worker's heartbeat expires
    swept = sweeper.sweep()
    assert (swept.dead_entries, swept.forgotten_workers) == (8, 1)
    # Blocks only the dead worker held are gone entirely; shared ones keep the live holder.
    assert keys_of(client) == {
        *(live.keys.block(h) for h in HASHES[:3]),
        live.keys.worker_blocks("live"),
        live.keys.heartbeat("live"),
        live.keys.workers,
    }
    assert client.hgetall(live.keys.workers) == {"live": str(live.epoch)}
    assert index.lookup(HASHES) == {"live": 3}


def test_a_round_removes_at_most_batch_entries(redis_url: str) -> None:
    dead = publisher(redis_url, "dead", ttl=0.2)
    dead.publish([KVEvent("stored", HASHES, 8 * BS)])
    time.sleep(0.3)
    sweeper = IndexSweeper(PrefixIndex(redis_url, "m", BS), batch=3, scan_count=1)
    rounds = [sweeper.sweep() for _ in range(3)]
    assert rounds[0].dead_entries == 3 and all(r.dead_entries <= 3 for r in rounds)
    # The scan (one key a round here) may have found some of them first.
    assert sum(r.dead_entries + r.stale_entries for r in rounds) == 8
    assert sum(r.forgotten_workers for r in rounds) == 1
    assert keys_of(redis.Redis.from_url(redis_url, decode_responses=True)) == set()


def test_the_scan_removes_entries_of_a_superseded_epoch(redis_url: str) -> None:
    live = publisher(redis_url, "a", ttl=10)
    live.publish([KVEvent("stored", HASHES[:2], 2 * BS)])
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    # Late writes of an older incarnation, and an entry whose block set was lost.
    client.hset(live.keys.block(HASHES[5]), "a", str(live.epoch - 1))
    client.hset(live.keys.block(HASHES[6]), "ghost", "7")
    client.sadd(live.keys.worker_blocks("a"), HASHES[5])
    sweeper = IndexSweeper(PrefixIndex(redis_url, "m", BS), scan_count=2)
    stale = 0
    for _ in range(100):  # one full pass of the scan
        swept = sweeper.sweep()
        stale += swept.stale_entries
        if swept.pass_complete:
            break
    assert stale == 2
    assert not client.exists(live.keys.block(HASHES[5]), live.keys.block(HASHES[6]))
    assert client.smembers(live.keys.worker_blocks("a")) == {str(h) for h in HASHES[:2]}
    assert PrefixIndex(redis_url, "m", BS).lookup(HASHES) == {"a": 2}


def test_the_scan_keeps_to_its_model_even_with_glob_characters(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    other = "pdserve:{m1}:blk:5"
    client.hset(other, "nobody", "1")  # no heartbeat: would be swept as stale
    sweeper = IndexSweeper(PrefixIndex(redis_url, "m[1]", BS))  # as a glob, [1] matches "1"
    assert sweeper.sweep().pass_complete
    assert client.hgetall(other) == {"nobody": "1"}


def test_a_worker_that_heartbeats_again_is_left_alone(redis_url: str) -> None:
    a = publisher(redis_url, "a", ttl=0.5)
    a.publish([KVEvent("stored", HASHES, 8 * BS)])
    time.sleep(0.6)
    assert a.heartbeat()  # back before any sweep: resynchronised under the same epoch
    sweeper = IndexSweeper(PrefixIndex(redis_url, "m", BS))
    assert sweeper.sweep().dead_entries == 0
    assert PrefixIndex(redis_url, "m", BS).lookup(HASHES) == {"a": 8}


def test_maintenance_thread_collects_without_being_asked(redis_url: str) -> None:
    dead, live = publisher(redis_url, "dead", ttl=0.3), publisher(redis_url, "live", ttl=10)
    dead.publish([KVEvent("stored", HASHES, 8 * BS)])
    live.publish([KVEvent("stored", HASHES[:1], BS)])
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    maintenance = IndexMaintenance(PrefixIndex(redis_url, "m", BS), interval_s=0.1).start()
    try:
        assert eventually(lambda: not client.exists(dead.keys.worker_blocks("dead")))
        assert client.hkeys(dead.keys.block(HASHES[0])) == ["live"]
        assert not client.exists(dead.keys.block(HASHES[1]))
    finally:
        maintenance.stop()
