"""Redis going away mid-run: nobody sees an exception, routing is told, the index comes back
(through the blocking client and the router's asyncio one)."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
from prometheus_client import REGISTRY

from pdserve.core.block_hash import prompt_block_hashes
from pdserve.core.kv_events import KVEvent
from pdserve.prefix_index.lookup import PrefixIndex
from pdserve.prefix_index.publisher import PrefixIndexPublisher
from pdserve.prefix_index.redis_link import MAX_ASYNC_CONNECTIONS, connect, connect_async
from pdserve.prefix_index.redis_server import RedisServer, free_port

BS = 4
HASHES = prompt_block_hashes(list(range(64)), BS)


def redis_up() -> float | None:
    return REGISTRY.get_sample_value("pdserve_redis_up")


def eventually(check, timeout_s: float = 5.0):
    deadline = time.monotonic() + timeout_s
    while True:
        result = check()
        if result or time.monotonic() > deadline:
            return result
        time.sleep(0.05)


def test_outage_degrades_then_resyncs(own_redis: RedisServer, caplog) -> None:
    pub = PrefixIndexPublisher(own_redis.url, "a", "m", BS, heartbeat_ttl_s=5)
    assert pub.register()
    pub.publish([KVEvent("stored", HASHES[:4], 4 * BS)])
    index = PrefixIndex(own_redis.url, "m", BS)
    assert index.lookup(HASHES) == {"a": 4}
    assert index.available and redis_up() == 1

    own_redis.stop()
    caplog.set_level(logging.WARNING)
    started = time.monotonic()
    for _ in range(50):  # a burst of routing while Redis is gone
        assert index.lookup(HASHES) == {}
        index.record_reuse("a", 10, 10)
        assert index.stats().total.requests == 0
    assert time.monotonic() - started < 2.0  # backoff: a dead Redis never stalls routing
    assert not index.available and redis_up() == 0
    unavailable = [r for r in caplog.records if "routing on load alone" in r.getMessage()]
    assert len(unavailable) == 1  # one line per outage, not one per request

    # The worker keeps caching while Redis is down; its events cannot be delivered.
    assert not pub.publish([KVEvent("stored", HASHES[4:8], 4 * BS)])
    assert not pub.publish([KVEvent("removed", HASHES[:1], BS)])
    assert not pub.heartbeat()
    assert not pub.available

    own_redis.start()  # a fresh, empty Redis on the same port
    assert eventually(lambda: index.lookup(HASHES) == {} and index.available)
    assert redis_up() == 1
    # The worker's next heartbeat rewrites its whole current set, outage changes included.
    assert eventually(pub.heartbeat)
    assert index.lookup(HASHES) == {}  # block 0 was evicted during the outage
    assert index.lookup(HASHES[1:]) == {"a": 7}
    assert pub.held_hashes == frozenset(HASHES[1:8])


def test_redis_down_from_the_start(caplog) -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    index = PrefixIndex(url, "m", BS)
    assert index.lookup(HASHES) == {}
    assert not index.available
    pub = PrefixIndexPublisher(url, "a", "m", BS)
    assert not pub.register()
    assert not pub.publish([KVEvent("stored", HASHES[:2], 2 * BS)])
    assert pub.needs_resync


def test_publisher_recovers_through_publish_too(own_redis: RedisServer) -> None:
    pub = PrefixIndexPublisher(own_redis.url, "a", "m", BS, heartbeat_ttl_s=5)
    assert pub.register()
    own_redis.stop()
    assert not pub.publish([KVEvent("stored", HASHES[:3], 3 * BS)])
    own_redis.start()
    assert eventually(lambda: pub.publish([KVEvent("stored", HASHES[3:5], 2 * BS)]))
    assert PrefixIndex(own_redis.url, "m", BS).lookup(HASHES) == {"a": 5}


def test_password_urls() -> None:
    with RedisServer(password="s3cr:t/") as server:
        assert "s3cr%3At%2F@" in server.url
        pub = PrefixIndexPublisher(server.url, "a", "m", BS)
        assert pub.register() and pub.publish([KVEvent("stored", HASHES[:2], 2 * BS)])
        assert PrefixIndex(server.url, "m", BS).lookup(HASHES) == {"a": 2}
        wrong = PrefixIndex(f"redis://:nope@127.0.0.1:{server.port}/0", "m", BS)
        assert wrong.lookup(HASHES) == {}  # refused: degrades like an outage, never raises
        assert not wrong.available


@pytest.mark.parametrize(
    ("url", "ssl"),
    [("redis://:pw@localhost:6379/2", False), ("rediss://user:pw@example.com:6380/0", True)],
)
def test_tls_and_credentials_are_taken_from_the_url(url: str, ssl: bool) -> None:
    client = connect(url, socket_timeout_s=0.3)
    kwargs = client.connection_pool.connection_kwargs
    assert kwargs["password"] == "pw" and kwargs["socket_timeout"] == 0.3
    assert (client.connection_pool.connection_class.__name__ == "SSLConnection") is ssl


def test_the_asyncio_door_degrades_and_recovers_alike(own_redis: RedisServer) -> None:
    """`lookup_async` (the router's) keeps `lookup`'s contract through an outage."""
    pub = PrefixIndexPublisher(own_redis.url, "a", "m", BS, heartbeat_ttl_s=5)
    assert pub.register() and pub.publish([KVEvent("stored", HASHES[:4], 4 * BS)])
    index = PrefixIndex(own_redis.url, "m", BS)

    async def outage() -> None:
        assert await index.lookup_async(HASHES) == {"a": 4}
        own_redis.stop()
        started = time.monotonic()
        for _ in range(50):
            assert await index.lookup_async(HASHES) == {}
        assert time.monotonic() - started < 2.0  # the same backoff as the blocking door
        assert not index.available
        own_redis.start()  # empty: the worker has not resynchronised yet
        deadline = time.monotonic() + 5.0
        while (await index.lookup_async(HASHES)) != {} or not index.available:
            assert time.monotonic() < deadline, "the asyncio client did not reconnect"
            await asyncio.sleep(0.05)
        assert pub.heartbeat() or eventually(pub.heartbeat)
        assert await index.lookup_async(HASHES) == {"a": 4}  # the script is loaded again
        await index.aclose()

    asyncio.run(outage())


def test_the_asyncio_client_takes_credentials_and_tls_from_the_url() -> None:
    async def check() -> None:
        client = connect_async("rediss://user:pw@example.com:6380/0", socket_timeout_s=0.3)
        kwargs = client.connection_pool.connection_kwargs
        assert kwargs["password"] == "pw" and kwargs["socket_timeout"] == 0.3
        assert client.connection_pool.connection_class.__name__ == "SSLConnection"
        assert client.connection_pool.max_connections == MAX_ASYNC_CONNECTIONS
        await client.aclose()

    asyncio.run(check())
