"""The bundled redis-server dies (kill -9): it comes back on its own on the same port and
password, the index's clients recover, and `pdserve_redis_up` follows without any traffic."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import redis
from prometheus_client import REGISTRY

from pdserve.app import ServingApp
from pdserve.config import ServeConfig
from pdserve.core.block_hash import prompt_block_hashes
from pdserve.core.kv_events import KVEvent
from pdserve.prefix_index.lookup import PrefixIndex
from pdserve.prefix_index.maintenance import IndexMaintenance
from pdserve.prefix_index.publisher import PrefixIndexPublisher
from pdserve.prefix_index.redis_link import connect
from pdserve.prefix_index.redis_server import RedisServer

BS = 4
HASHES = prompt_block_hashes(list(range(64)), BS)


def redis_up() -> float | None:
    return REGISTRY.get_sample_value("pdserve_redis_up")


def eventually(check, timeout_s: float = 10.0, every_s: float = 0.01) -> bool:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(every_s)
    return True


def test_killed_server_comes_back_and_the_index_works_again() -> None:
    with RedisServer(supervise=True, check_interval_s=0.05, restart_delay_s=0.5) as server:
        url, first_pid = server.url, server.pid
        pub = PrefixIndexPublisher(url, "a", "m", BS, heartbeat_ttl_s=5)
        assert pub.register() and pub.publish([KVEvent("stored", HASHES[:4], 4 * BS)])
        index = PrefixIndex(url, "m", BS)
        assert index.lookup(HASHES) == {"a": 4}
        # No request is routed from here on: only the maintenance ping moves the gauge.
        maintenance = IndexMaintenance(index, interval_s=0.05).start()
        try:
            assert eventually(lambda: redis_up() == 1)
            os.kill(first_pid, signal.SIGKILL)
            assert eventually(lambda: redis_up() == 0, timeout_s=3)
            assert eventually(lambda: server.restarts == 1, timeout_s=5)
            assert server.running and server.pid != first_pid and server.url == url
            assert eventually(lambda: redis_up() == 1, timeout_s=3)
        finally:
            maintenance.stop()
        # The restarted server is empty; the worker's next heartbeat rewrites its entries.
        assert eventually(pub.heartbeat)
        assert index.lookup(HASHES) == {"a": 4} and index.available


def test_a_stopped_server_stays_stopped() -> None:
    server = RedisServer(supervise=True, check_interval_s=0.05, restart_delay_s=0.05).start()
    pid = server.pid
    server.stop()
    time.sleep(0.3)
    assert not server.running and server.restarts == 0
    server.start()  # and supervised again after a start
    assert server.pid != pid
    os.kill(server.pid, signal.SIGKILL)
    assert eventually(lambda: server.restarts == 1 and server.running, timeout_s=5)
    server.close()


def test_serve_supervises_its_private_redis() -> None:
    app = ServingApp(ServeConfig())

    async def start_redis_then_kill_it() -> str:
        url = await app._start_private_redis()
        os.kill(app.redis_server.pid, signal.SIGKILL)
        return url

    url = asyncio.run(start_redis_then_kill_it())
    try:
        client = redis.Redis.from_url(url, socket_timeout=1)
        assert eventually(lambda: app.redis_server.restarts == 1, timeout_s=5)
        assert client.ping()
        anonymous = connect(f"redis://127.0.0.1:{app.redis_server.port}/0", socket_timeout_s=1)
        assert eventually(lambda: _refused(anonymous))
    finally:
        asyncio.run(app.stop())
    assert not app.redis_server.running


def _refused(client: redis.Redis) -> bool:
    try:
        client.get("k")
    except redis.AuthenticationError:
        return True
    return False
