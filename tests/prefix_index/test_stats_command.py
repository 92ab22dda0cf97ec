"""`pdserve stats` reads the reuse statistics the router keeps in Redis."""

from __future__ import annotations

import argparse
import asyncio
import json
import os

from pdserve.app import ServingApp
from pdserve.commands import stats
from pdserve.config import RouterConfig, ServeConfig
from pdserve.prefix_index import local_servers
from pdserve.prefix_index.lookup import PrefixIndex
from pdserve.prefix_index.redis_server import RedisServer


def run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    stats.add_arguments(parser)
    return stats.run(parser.parse_args(argv))


def test_prints_hits_and_misses_per_worker_and_model(redis_url: str, capsys) -> None:
    index = PrefixIndex(redis_url, "tiny", 16)
    index.record_reuse("prefill-0", hit_tokens=320, miss_tokens=64)
    index.record_reuse("decode-1", hit_tokens=0, miss_tokens=128)
    assert run(["--redis-url", redis_url]) == 0
    table = capsys.readouterr().out
    assert "prefill-0" in table and "83.3%" in table and "62.5%" in table
    assert run(["--redis-url", redis_url, "--json", "--model", "tiny"]) == 0
    data = json.loads(capsys.readouterr().out)["tiny"]
    assert (data["hit_tokens"], data["miss_tokens"], data["requests"]) == (320, 192, 2)
    assert data["workers"]["decode-1"]["hit_rate"] == 0.0


def test_unreachable_redis_is_a_clear_error(capsys) -> None:
    with RedisServer(password="secret") as server:
        wrong = server.url.replace("secret", "wrong")
        assert run(["--redis-url", wrong]) == 1
    err = capsys.readouterr().err
    assert "cannot reach Redis" in err and "wrong" not in err  # the password is not echoed


def test_finds_the_private_server_of_a_local_serve(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.delenv("PDSERVE_REDIS_URL", raising=False)
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    app = ServingApp(ServeConfig(router=RouterConfig(port=50123)), advertise_redis_url=True)
    url = asyncio.run(app._start_private_redis())
    try:
        PrefixIndex(url, "tiny", 16).record_reuse("p", 1, 1)
        assert run(["--json"]) == 0
        assert json.loads(capsys.readouterr().out)["tiny"]["requests"] == 1
        assert run(["--json", "--port", "50123"]) == 0
        note = local_servers.notes_dir() / f"{os.getpid()}.json"
        assert note.stat().st_mode & 0o777 == 0o600  # it carries the password
        assert local_servers.notes_dir().stat().st_mode & 0o777 == 0o700
    finally:
        asyncio.run(app.stop())
    assert not note.exists()


def test_two_local_serves_keep_their_own_urls(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.delenv("PDSERVE_REDIS_URL", raising=False)
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    with RedisServer() as first, RedisServer() as second:
        # Two serving processes (the redis-servers' pids stand in for them: alive, distinct).
        local_servers.advertise(first.url, 50001, pid=first.pid)
        second_note = local_servers.advertise(second.url, 50002, pid=second.pid)
        PrefixIndex(first.url, "one", 16).record_reuse("p", 1, 1)
        PrefixIndex(second.url, "two", 16).record_reuse("p", 1, 1)
        assert run(["--json", "--port", "50001"]) == 0
        assert list(json.loads(capsys.readouterr().out)) == ["one"]
        assert run(["--json", "--port", "50002"]) == 0
        assert list(json.loads(capsys.readouterr().out)) == ["two"]

        assert run(["--json"]) == 2  # ambiguous: it says so instead of guessing
        err = capsys.readouterr().err
        assert "50001, 50002" in err and "--port" in err
        assert run(["--port", "50003"]) == 2
        assert "router port 50003" in capsys.readouterr().err

        local_servers.withdraw(second_note)
        assert run(["--json"]) == 0  # only one left: picked unasked
        assert list(json.loads(capsys.readouterr().out)) == ["one"]


def test_notes_of_dead_servers_are_ignored(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    with RedisServer() as server:
        pid = server.pid
        note = local_servers.advertise(server.url, 50001, pid=pid)
    assert local_servers.find_local_url() is None  # that process is gone
    assert not note.exists()
