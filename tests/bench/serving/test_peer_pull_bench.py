"""`pdserve bench peer-pull` at its smallest size: the chat served on two workers without and
with --peer-pull, the figures computed from the workers' stats and the records, the ratios from
the two rows (not from any target)."""

from __future__ import annotations

import json

import pytest

from pdserve.bench.serving import peer_pull_bench
from tests.bench.cli_args import bench_args
from tests.bench.serving.multi_turn_chat_checks import (
    SMALLEST_CHAT,
    check_each_way_served_the_chat,
)


def test_serves_the_chat_both_ways_and_reports_pulled_tokens_and_ratios(
    ray_cluster, tmp_path, capsys
):
    path = tmp_path / "peer_pull.json"
    args = bench_args(peer_pull_bench, json=path, **SMALLEST_CHAT)
    assert peer_pull_bench.run(args) == 0
    document = json.loads(path.read_text())
    check_each_way_served_the_chat(document, peer_pull_bench.WAYS, args)
    for way in peer_pull_bench.WAYS:
        assert document[way]["ttft_p90_ms"] >= document[way]["ttft_p50_ms"]
    without, pull = document["without"], document["pull"]
    assert without["pulled_tokens"] == without["pulls_committed"] == 0
    # Round robin put some turn on the worker without its conversation's prefix: it pulled.
    assert pull["pulled_tokens"] > 0 and pull["pulls_committed"] > 0
    assert pull["computed_tokens"] < without["computed_tokens"]
    ratios = document["pull_over_without"]
    for name in peer_pull_bench.RATIO_FIELDS:
        assert ratios[name] == pytest.approx(pull[name] / without[name])
    printed = capsys.readouterr().out
    assert "pull/without" in printed and "pulled tokens" in printed


def test_ratios_are_the_rows_quotients_and_none_over_a_zero():
    row = dict.fromkeys(
        ("completed", "failed", "prompt_tokens", "minimum_tokens", "hit_tokens"), 1
    ) | {"pulled_tokens": 0, "pulls_committed": 0, "pulls_fallen_back": 0}
    without = peer_pull_bench.PullResult(
        **row, computed_tokens=300, ttft_p50_ms=40.0, ttft_p90_ms=0.0
    )
    pull = peer_pull_bench.PullResult(**row, computed_tokens=120, ttft_p50_ms=10.0, ttft_p90_ms=5.0)
    ratios = peer_pull_bench.pull_ratios({"without": without, "pull": pull})
    assert ratios == {"computed_tokens": 0.4, "ttft_p50_ms": 0.25, "ttft_p90_ms": None}
