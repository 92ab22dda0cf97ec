"""`pdserve bench kv-tiers` at its smallest size: the three systems served (no tier, host tier,
host over disk), the figures computed from the worker's stats and the records, the ratios from
the figures (not the issue's targets)."""

from __future__ import annotations

import json

import pytest

from pdserve.bench.serving import kv_tiers_bench
from tests.bench.cli_args import bench_args
from tests.bench.serving.multi_turn_chat_checks import (
    SMALLEST_CHAT,
    check_each_way_served_the_chat,
)

# Twice the conversations: a working set 4x the pool must still hold a request in flight.
SMALLEST = SMALLEST_CHAT | {"conversations": 8, "max_concurrency": 1}


def test_serves_the_chat_each_way_and_reports_computed_tokens_and_ratios(
    ray_cluster, tmp_path, capsys
):
    path = tmp_path / "kv_tiers.json"
    args = bench_args(kv_tiers_bench, json=path, **SMALLEST)
    assert kv_tiers_bench.run(args) == 0
    document = json.loads(path.read_text())
    check_each_way_served_the_chat(document, kv_tiers_bench.WAYS, args)
    for way in kv_tiers_bench.WAYS:
        assert document[way]["ttft_floor_ms"] > 0
    assert document["without"]["host_hit_tokens"] == document["without"]["disk_hit_tokens"] == 0
    assert document["host"]["host_hit_tokens"] > 0  # the evicted turns came back from the tier
    assert document["host"]["disk_hit_tokens"] == 0
    assert document["disk"]["disk_hit_tokens"] > 0  # most of them, from files in the disk way
    for way in ("host", "disk"):
        ratios = document["over_without"][way]
        for name in kv_tiers_bench.RATIO_FIELDS:
            expected = document[way][name] / document["without"][name]
            assert ratios[name] == pytest.approx(expected)
    printed = capsys.readouterr().out
    assert "4.0x" in printed and "host/without" in printed and "disk/without" in printed


def test_ways_must_start_without_and_name_known_systems():
    for ways in ("host", "without,ssd", "without,host,host"):
        with pytest.raises(SystemExit, match="--ways"):
            kv_tiers_bench.run(bench_args(kv_tiers_bench, ways=ways))


def test_a_pool_too_small_for_the_requests_in_flight_is_refused_naming_the_flags():
    args = bench_args(kv_tiers_bench, **(SMALLEST | {"conversations": 4, "max_concurrency": 2}))
    with pytest.raises(SystemExit, match="--working-set-ratio 4 leaves .* --max-concurrency 2"):
        kv_tiers_bench.run(args)
