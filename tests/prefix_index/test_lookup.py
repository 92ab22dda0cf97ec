"""The prefix index against a real redis-server: lookups, epochs, expiry, reuse statistics."""

from __future__ import annotations

import time

import pytest
import redis

from pdserve.core.block_hash import prompt_block_hashes
from pdserve.core.kv_events import KVEvent
from pdserve.prefix_index.lookup import PrefixIndex
from pdserve.prefix_index.publisher import PrefixIndexPublisher
from pdserve.prefix_index.reuse_stats import read_reuse_stats
from pdserve.prefix_index.sweeper import IndexSweeper
from tests.prefix_index.heartbeats import LAPSING_TTL_S, wait_lapsed

BS = 4
PROMPT = list(range(100, 132))  # 8 full blocks
HASHES = prompt_block_hashes(PROMPT, BS)


def stored(hashes: list[int]) -> KVEvent:
    return KVEvent("stored", list(hashes), len(hashes) * BS)


def removed(hashes: list[int]) -> KVEvent:
    return KVEvent("removed", list(hashes), len(hashes) * BS)


def publisher(url: str, worker: str, ttl: float = 10.0, model: str = "m") -> PrefixIndexPublisher:
    pub = PrefixIndexPublisher(url, worker, model, BS, heartbeat_ttl_s=ttl)
    assert pub.register()
    return pub


def test_lookup_counts_each_workers_leading_blocks(redis_url: str) -> None:
    a, b, c, d = (publisher(redis_url, w) for w in ("a", "b", "c", "d"))
    a.publish([stored(HASHES[:5])])
    b.publish([stored(HASHES[:2])])
    c.publish([stored(HASHES[1:])])  # lacks the first block: a later block alone is useless
    d.publish([stored(HASHES)])
    index = PrefixIndex(redis_url, "m", BS)
    assert index.lookup(HASHES) == {"a": 5, "b": 2, "d": 8}
    for n in range(1, len(HASHES) + 1):  # every prompt length, odd ones too
        expected = {w: min(n, held) for w, held in (("a", 5), ("b", 2), ("d", 8))}
        assert index.lookup(HASHES[:n]) == expected
    assert index.lookup([]) == {}


def test_a_gap_left_by_lost_entries_counts_between_the_gap_and_the_last_block(
    redis_url: str,
) -> None:
    """A worker's own entries never have a gap (the block manager caches a block only while
    its parent is cached); one can appear only when Redis loses an entry (say, a key evicted
    under maxmemory). The worker still holds those blocks, so any count from the gap to its
    last block is an estimate the engine corrects, and the lookup answers one of them."""
    publisher(redis_url, "a").publish([stored(HASHES)])
    redis.Redis.from_url(redis_url).delete(PrefixIndex(redis_url, "m", BS).keys.block(HASHES[3]))
    assert 3 <= PrefixIndex(redis_url, "m", BS).lookup(HASHES)["a"] <= 8


def test_chained_hashes_diverge_with_the_prompt(redis_url: str) -> None:
    a = publisher(redis_url, "a")
    a.publish([stored(HASHES)])
    other = PROMPT[:12] + [7] + PROMPT[13:]  # differs inside block 3
    index = PrefixIndex(redis_url, "m", BS)
    assert index.lookup(prompt_block_hashes(other, BS)) == {"a": 3}


def test_removed_blocks_stop_counting(redis_url: str) -> None:
    a = publisher(redis_url, "a")
    a.publish([stored(HASHES)])
    a.publish([removed(HASHES[:1:-1])])  # evicted as the block manager does: leaves first
    index = PrefixIndex(redis_url, "m", BS)
    assert index.lookup(HASHES) == {"a": 2}
    a.publish([removed(HASHES[:1]), stored(HASHES[:1])])  # order within a batch is kept
    assert index.lookup(HASHES) == {"a": 2}


def test_models_do_not_see_each_other(redis_url: str) -> None:
    publisher(redis_url, "a", model="m1").publish([stored(HASHES)])
    assert PrefixIndex(redis_url, "m2", BS).lookup(HASHES) == {}
    assert PrefixIndex(redis_url, "m1", BS).lookup(HASHES) == {"a": 8}


def test_lookup_is_one_round_trip(redis_url: str) -> None:
    for worker in ("a", "b", "c"):
        publisher(redis_url, worker).publish([stored(HASHES)])
    index = PrefixIndex(redis_url, "m", BS)
    index.lookup(HASHES)  # loads the script
    calls = []
    real = index.link.client.execute_command
    index.link.client.execute_command = lambda *a, **k: calls.append(a[0]) or real(*a, **k)
    assert index.lookup(HASHES) == {"a": 8, "b": 8, "c": 8}
    assert calls == ["EVALSHA"]


def test_lookup_sends_one_key_whatever_the_prompt_length(redis_url: str) -> None:
    """The other blocks' keys are built inside the script: a 4k-token prompt's 256 key names
    cost the router more to encode and send than the lookup costs Redis."""
    long_prompt = list(range(100, 100 + 64 * BS))
    hashes = prompt_block_hashes(long_prompt, BS)
    publisher(redis_url, "a").publish([stored(hashes[:40])])
    index = PrefixIndex(redis_url, "m", BS)
    index.lookup(hashes)  # loads the script
    sent = []
    real = index.link.client.execute_command
    index.link.client.execute_command = lambda *a, **k: sent.append(a) or real(*a, **k)
    assert index.lookup(hashes) == {"a": 40}
    ((command, _sha, numkeys, *rest),) = sent
    assert command == "EVALSHA" and numkeys == 1 and len(rest) == 4


def test_prefix_shared_by_many_workers_counts_each_exactly(redis_url: str) -> None:
    """A system prompt held by many workers: blocks whose holders equal block lo's take the
    fast path, and every difference (fewer blocks, a stale epoch, another insertion order, a
    dead worker) is still seen per worker."""
    long_prompt = list(range(100, 100 + 48 * BS))
    hashes = prompt_block_hashes(long_prompt, BS)
    workers = {f"w{i}": publisher(redis_url, f"w{i}") for i in range(20)}
    for pub in workers.values():
        pub.publish([stored(hashes[:32])])
    workers["w3"].publish([removed(hashes[31:9:-1])])  # evicted down to 10 blocks
    workers["w4"].publish([stored(hashes[32:])])  # the whole prompt
    workers["w5"].publish([removed(hashes[20:21]), stored(hashes[20:21])])  # moved to the end
    workers["w8"].publish([removed(hashes[31:0:-1])])  # only the first block is left
    client = redis.Redis.from_url(redis_url)
    for h in hashes[25:32]:  # left by an older epoch of w6, which holds only 25 blocks now
        client.hset(workers["w6"].keys.block(h), "w6", str(workers["w6"].epoch - 1))
    index = PrefixIndex(redis_url, "m", BS)
    expected = {w: 32 for w in workers} | {"w3": 10, "w4": 48, "w6": 25, "w8": 1}
    assert index.lookup(hashes) == expected
    client.delete(workers["w7"].keys.heartbeat("w7"))  # as when its heartbeat lapses
    del expected["w7"]
    assert index.lookup(hashes) == expected


def test_restarted_worker_entries_are_gone(redis_url: str) -> None:
    old = publisher(redis_url, "a")
    old.publish([stored(HASHES)])
    index = PrefixIndex(redis_url, "m", BS)
    assert index.lookup(HASHES) == {"a": 8}
    # The actor restarts: a new process, a new epoch, an empty cache.
    new = publisher(redis_url, "a")
    assert index.lookup(HASHES) == {}
    new.publish([stored(HASHES[:2])])
    assert index.lookup(HASHES) == {"a": 2}
    # The old incarnation is fenced: its writes and heartbeats change nothing.
    assert not old.heartbeat() and old.fenced
    assert not old.publish([stored(HASHES)])
    assert index.lookup(HASHES) == {"a": 2}
    assert index.live_workers() == {"a": new.epoch}


def test_live_workers_are_the_registered_ones_whose_heartbeat_holds_their_epoch(
    redis_url: str,
) -> None:
    index = PrefixIndex(redis_url, "m", BS)
    assert index.live_workers() == {}  # nobody registered: the script's empty answer
    a, b = publisher(redis_url, "a"), publisher(redis_url, "b", ttl=LAPSING_TTL_S)
    assert index.live_workers() == {"a": a.epoch, "b": b.epoch}
    wait_lapsed(redis_url, b)  # b's heartbeat lapsed; it stays registered
    assert index.live_workers() == {"a": a.epoch}
    assert b.heartbeat()
    assert index.live_workers() == {"a": a.epoch, "b": b.epoch}
    index.close()


def test_entries_of_a_stale_epoch_never_count(redis_url: str) -> None:
    a = publisher(redis_url, "a")
    a.publish([stored(HASHES[:2])])
    # An entry left by an older epoch that cleanup missed (e.g. written during a partition).
    client = redis.Redis.from_url(redis_url)
    client.hset(a.keys.block(HASHES[2]), "a", str(a.epoch - 1))
    assert PrefixIndex(redis_url, "m", BS).lookup(HASHES) == {"a": 2}


def test_dead_worker_expires_and_live_one_stays(redis_url: str) -> None:
    dead, live = publisher(redis_url, "dead", ttl=LAPSING_TTL_S), publisher(redis_url, "live")
    dead.publish([stored(HASHES)])
    live.publish([stored(HASHES)])
    index = PrefixIndex(redis_url, "m", BS)
    assert index.lookup(HASHES) == {"dead": 8, "live": 8}
    wait_lapsed(redis_url, dead)  # only "live" heartbeats
    assert live.heartbeat()
    assert index.lookup(HASHES) == {"live": 8}
    assert IndexSweeper(index).sweep().forgotten_workers == 1
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    assert client.hkeys(dead.keys.block(HASHES[0])) == ["live"]
    assert not client.exists(dead.keys.worker_blocks("dead"))


def test_heartbeat_after_expiry_restores_entries(redis_url: str) -> None:
    a = publisher(redis_url, "a", ttl=0.3)
    a.publish([stored(HASHES)])
    index = PrefixIndex(redis_url, "m", BS)
    time.sleep(0.4)  # a long pause: the heartbeat lapsed and garbage collection ran
    assert index.lookup(HASHES) == {}
    assert IndexSweeper(index).sweep().forgotten_workers == 1
    assert a.heartbeat()  # notices its entries may be gone and rewrites them
    assert index.lookup(HASHES) == {"a": 8}


def test_unregister_removes_everything_now(redis_url: str) -> None:
    a = publisher(redis_url, "a")
    a.publish([stored(HASHES)])
    a.unregister()
    assert PrefixIndex(redis_url, "m", BS).lookup(HASHES) == {}


def test_reuse_statistics_per_worker_and_model(redis_url: str) -> None:
    index = PrefixIndex(redis_url, "m", BS)
    index.record_reuse("a", hit_tokens=30, miss_tokens=10)
    index.record_reuse("a", hit_tokens=0, miss_tokens=20)
    index.record_reuse("b", hit_tokens=60, miss_tokens=0)
    PrefixIndex(redis_url, "other", BS).record_reuse("a", 1, 1)
    stats = index.stats()
    assert (stats.total.hit_tokens, stats.total.miss_tokens, stats.total.requests) == (90, 30, 3)
    assert stats.total.hit_rate == pytest.approx(0.75)
    assert stats.workers["a"].hit_tokens == 30 and stats.workers["a"].requests == 2
    assert stats.workers["b"].hit_rate == 1.0
    everything = read_reuse_stats(redis.Redis.from_url(redis_url))
    assert sorted(everything) == ["m", "other"]
    assert everything["other"].total.requests == 1


def test_model_names_with_braces_are_refused(redis_url: str) -> None:
    with pytest.raises(ValueError, match="braces"):
        PrefixIndex(redis_url, "m{1}", BS)
