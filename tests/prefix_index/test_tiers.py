"""The prefix index records each holder's tier (--kv-offload-gb): a block the device evicts into
host memory stays indexed (an update, not a removal) and is listed among the worker's host
blocks; brought back, it leaves that list; resyncs and the sweeper keep the list true. The
events come from a real block manager with a host tier."""

from __future__ import annotations

import time

import redis

from pdserve.core.block_hash import prompt_block_hashes
from pdserve.core.messages import WorkerStats
from pdserve.prefix_index.lookup import PrefixIndex
from pdserve.prefix_index.publisher import PrefixIndexPublisher
from pdserve.prefix_index.sweeper import IndexSweeper
from router.cost_model import CostModel
from tests.engine.test_disk_tier import A_TOKENS as DISK_A
from tests.engine.test_disk_tier import disk_tiered, pushed_to_disk, settled
from tests.engine.test_host_tier import BS, compute, seq, tiered
from tests.prefix_index.heartbeats import LAPSING_TTL_S, wait_lapsed

A_TOKENS, B_TOKENS = list(range(13)), list(range(100, 116))


def publisher(url: str, worker: str, ttl: float = 10.0) -> PrefixIndexPublisher:
    pub = PrefixIndexPublisher(url, worker, "m", BS, heartbeat_ttl_s=ttl)
    assert pub.register()
    return pub


def evicted_to_host(pub: PrefixIndexPublisher):
    """A worker of 4 device blocks computes A (3 full blocks), then B evicts A to the host."""
    bm, kv = tiered(num_blocks=4, host_blocks=8)
    for i, tokens in enumerate((A_TOKENS, B_TOKENS)):
        s = seq(tokens, i)
        assert compute(bm, kv, s, i)
        bm.release(s)
        assert pub.publish(bm.take_events())
    return bm


def test_moving_to_host_is_an_update_and_coming_back_another(redis_url: str) -> None:
    pub = publisher(redis_url, "w")
    bm = evicted_to_host(pub)
    index = PrefixIndex(redis_url, "m", BS)
    a_hashes = prompt_block_hashes(A_TOKENS, BS)
    b_hashes = prompt_block_hashes(B_TOKENS, BS)
    assert index.lookup(a_hashes) == {"w": 3}  # still held: in host memory
    assert index.tier_blocks("w", a_hashes, "host") == 3
    assert index.lookup(b_hashes) == {"w": 4} and index.tier_blocks("w", b_hashes, "host") == 0

    assert bm.acquire_prefix(seq(A_TOKENS, 2), 12) == 12  # copied back, evicting 3 of B's
    assert pub.publish(bm.take_events())
    assert index.lookup(a_hashes) == {"w": 3} and index.tier_blocks("w", a_hashes, "host") == 0
    assert index.lookup(b_hashes) == {"w": 4}
    # B's evicted blocks are its last ones (released tail first): the hit's tail is on the host.
    assert index.tier_blocks("w", b_hashes, "host") == 3
    assert index.tier_blocks("w", b_hashes[:1], "host") == 0


def test_a_resync_rewrites_the_host_list(redis_url: str) -> None:
    pub = publisher(redis_url, "w")
    evicted_to_host(pub)
    client = redis.Redis.from_url(redis_url)
    key = pub.keys.worker_tier_blocks("w", "host")
    before = client.smembers(key)
    client.delete(key)
    client.srem(key, *before)
    assert pub.resync()
    assert client.smembers(key) == before and len(before) == 3


def test_a_dead_workers_host_list_is_swept(redis_url: str) -> None:
    pub = publisher(redis_url, "dead", ttl=0.3)
    evicted_to_host(pub)
    client = redis.Redis.from_url(redis_url)
    assert client.exists(pub.keys.worker_tier_blocks("dead", "host"))
    time.sleep(0.4)
    IndexSweeper(PrefixIndex(redis_url, "m", BS)).sweep()
    assert not client.exists(pub.keys.worker_tier_blocks("dead", "host"))


def test_unregister_drops_the_host_list(redis_url: str) -> None:
    pub = publisher(redis_url, "w")
    evicted_to_host(pub)
    pub.unregister()
    assert not redis.Redis.from_url(redis_url).exists(pub.keys.worker_tier_blocks("w", "host"))


def test_the_cost_model_prices_a_hit_by_tier_at_the_measured_bandwidth() -> None:
    cost = CostModel()
    assert cost.hit_seconds("device", 64 << 20) == 0.0
    prior = cost.hit_seconds("host", 64 << 20)
    assert prior > 0
    cost.observe_stats(WorkerStats("p0", "prefill", 1, host_copy_bytes_per_s=1_000_000_000))
    measured = cost.hit_seconds("host", 64 << 20)
    assert measured > prior  # a slower host link than the prior's (12 GB/s)
    assert measured == (64 << 20) / 1e9


def test_the_index_lists_disk_blocks_and_the_sweeper_drops_a_dead_workers(
    redis_url: str, tmp_path
) -> None:
    """A's blocks pushed device -> host -> disk by a real block manager with a disk tier: still
    held (an update each time), listed as on disk, not on the host; read back, they leave the
    list; when the worker dies the sweeper deletes its disk list with its blocks."""
    pub = publisher(redis_url, "dead", ttl=LAPSING_TTL_S)
    bm, kv = disk_tiered(tmp_path, num_blocks=4, host_blocks=3, disk_blocks=8)
    pushed_to_disk(bm, kv)
    settled(bm)  # the index hears of a disk block once its file is written
    assert pub.publish(bm.take_events())
    index = PrefixIndex(redis_url, "m", BS)
    a_hashes = prompt_block_hashes(DISK_A, BS)
    assert index.lookup(a_hashes) == {"dead": 3}
    assert index.tier_blocks("dead", a_hashes, "disk") == 3
    assert index.tier_blocks("dead", a_hashes, "host") == 0
    assert CostModel().hit_seconds("disk", 3 << 20) > CostModel().hit_seconds("host", 3 << 20)

    assert bm.acquire_prefix(seq(DISK_A, 5), 12) == 12
    settled(bm)
    assert pub.publish(bm.take_events())
    assert index.lookup(a_hashes) == {"dead": 3}
    assert index.tier_blocks("dead", a_hashes, "disk") == 0
    client = redis.Redis.from_url(redis_url)
    disk_key = pub.keys.worker_tier_blocks("dead", "disk")
    assert client.scard(disk_key) > 0  # the other prompts' blocks pushed down meanwhile
    wait_lapsed(redis_url, pub)
    IndexSweeper(PrefixIndex(redis_url, "m", BS)).sweep()
    assert not client.exists(disk_key) and index.lookup(a_hashes) == {}
