"""`pdserve stats` reads the reuse and speculative decoding statistics the router keeps in
Redis."""

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
from pdserve.prefix_index.spec_stats import read_speculation_stats, record_speculation


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
        assert run(["--json", "--target", "127.0.0.1:50123"]) == 0
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
        assert run(["--json", "--target", "127.0.0.1:50001"]) == 0
        assert list(json.loads(capsys.readouterr().out)) == ["one"]
        assert run(["--json", "--target", "localhost:50002"]) == 0
        assert list(json.loads(capsys.readouterr().out)) == ["two"]
        # The flag before --target still works, with a warning.
        assert run(["--json", "--port", "50002"]) == 0
        captured = capsys.readouterr()
        assert list(json.loads(captured.out)) == ["two"]
        assert "--port is deprecated" in captured.err

        assert run(["--json"]) == 2  # ambiguous: it says so instead of guessing
        err = capsys.readouterr().err
        assert "50001, 50002" in err and "--target" in err
        assert run(["--target", "127.0.0.1:50003"]) == 2
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and "no pdserve server at router port 50003" in err[0]

        local_servers.withdraw(second_note)
        assert run(["--json"]) == 0  # only one left: picked unasked
        assert list(json.loads(capsys.readouterr().out)) == ["one"]


def test_no_server_at_all_is_one_line(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.delenv("PDSERVE_REDIS_URL", raising=False)
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))  # no local serve noted
    # Nothing local and nothing at the default Redis address (a closed port stands in for it).
    with RedisServer() as server:
        closed = server.url
    monkeypatch.setattr(stats, "DEFAULT_URL", closed)
    assert run([]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err == [
        "error: no pdserve server found on this machine: is `pdserve serve` running? "
        "(--target, or --redis-url for a remote one)"
    ]


def test_notes_of_dead_servers_are_ignored(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    with RedisServer() as server:
        pid = server.pid
        note = local_servers.advertise(server.url, 50001, pid=pid)
    assert local_servers.find_local_url() is None  # that process is gone
    assert not note.exists()


def test_pdserve_stats_prints_acceptance_per_worker(redis_url: str, capsys) -> None:
    index = PrefixIndex(redis_url, "tiny", 16)
    index.record_reuse("decode-0", hit_tokens=16, miss_tokens=16)
    record_speculation(index.link, index.keys, "decode-0", (40, 30, 10))
    record_speculation(index.link, index.keys, "decode-0", (20, 6, 5))
    record_speculation(index.link, index.keys, "decode-1", (0, 0, 0))  # nothing: not written
    record_speculation(index.link, index.keys, "decode-1", (10, 0, 10))
    assert run(["--redis-url", redis_url, "--json"]) == 0
    spec = json.loads(capsys.readouterr().out)["tiny"]["speculation"]
    assert (spec["draft_tokens"], spec["accepted_tokens"], spec["verify_steps"]) == (70, 36, 25)
    assert spec["workers"]["decode-0"]["acceptance_rate"] == 0.6
    assert spec["workers"]["decode-0"]["mean_accepted"] == 2.4
    assert spec["workers"]["decode-1"]["acceptance_rate"] == 0.0
    assert run(["--redis-url", redis_url]) == 0
    table = capsys.readouterr().out
    assert "speculative decoding: tiny" in table
    assert "60.0%" in table and "2.40" in table and "51.4%" in table


def test_models_without_speculation_have_no_speculation_section(redis_url: str, capsys) -> None:
    index = PrefixIndex(redis_url, "plain", 16)
    index.record_reuse("decode-0", hit_tokens=1, miss_tokens=1)
    assert read_speculation_stats(index.link.client, ["plain"]) == {}
    assert run(["--redis-url", redis_url]) == 0
    assert "speculative decoding" not in capsys.readouterr().out


def test_pdserve_stats_shows_the_online_plan(redis_url: str, capsys) -> None:
    index = PrefixIndex(redis_url, "planned", 16)
    index.record_reuse("decode-0", hit_tokens=1, miss_tokens=1)
    assert run(["--redis-url", redis_url, "--json", "--model", "planned"]) == 0
    assert "plan" not in json.loads(capsys.readouterr().out)["planned"]
    plan = {
        "recommended": "1P:3D",
        "workers": 4,
        "goodput_rps": 12.5,
        "observed_rps": 20.0,
        "workers_for_observed": 7,
    }
    index.publish_plan(plan)
    assert run(["--redis-url", redis_url, "--json", "--model", "planned"]) == 0
    assert json.loads(capsys.readouterr().out)["planned"]["plan"] == plan
    assert run(["--redis-url", redis_url, "--model", "planned"]) == 0
    out = capsys.readouterr().out
    assert "online plan: 1P:3D for 4 workers" in out and "~7 workers" in out
