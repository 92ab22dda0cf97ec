"""`pdserve stats` reads the reuse statistics the router keeps in Redis."""

from __future__ import annotations

import argparse
import json

from pdserve.commands import stats
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
    url_file = tmp_path / "redis-url"
    monkeypatch.delenv("PDSERVE_REDIS_URL", raising=False)
    monkeypatch.setattr("pdserve.prefix_index.redis_server.LOCAL_URL_FILE", url_file)
    with RedisServer(url_file=url_file) as server:
        assert url_file.read_text().strip() == server.url
        PrefixIndex(server.url, "tiny", 16).record_reuse("p", 1, 1)
        assert run(["--json"]) == 0
        assert json.loads(capsys.readouterr().out)["tiny"]["requests"] == 1
    assert not url_file.exists()
