"""`pdserve bench kv-tiers` at its smallest size: the three systems served (no tier, host tier,
host over disk), the figures computed from the worker's stats and the records, the ratios from
the figures (not the issue's targets)."""

from __future__ import annotations

import json

import pytest

from pdserve.bench.serving import kv_tiers_bench
from pdserve.bench.serving.kv_tiers_bench import minimum_prefill_tokens
from tests.bench.cli_args import bench_args

SMALLEST = {
    "conversations": 8,
    "turns": 3,
    "system_prompts": 2,
    "system_prompt_len": 64,
    "user_len": 32,
    "output_len": 4,
    "max_concurrency": 1,
}


def test_serves_the_chat_each_way_and_reports_computed_tokens_and_ratios(
    ray_cluster, tmp_path, capsys
):
    path = tmp_path / "kv_tiers.json"
    args = bench_args(kv_tiers_bench, json=path, **SMALLEST)
    assert kv_tiers_bench.run(args) == 0
    document = json.loads(path.read_text())
    from pdserve.bench.common.local_system import load_model

    _, model_config = load_model(args)
    prompts = [r.prompt for r in kv_tiers_bench.chat_requests(args, model_config)]
    for way in kv_tiers_bench.WAYS:
        r = document[way]
        assert r["failed"] == 0 and r["completed"] == len(prompts)
        assert r["prompt_tokens"] == sum(len(p) for p in prompts)
        # Every prompt token is either computed or found in a cache.
        assert r["computed_tokens"] + r["hit_tokens"] == r["prompt_tokens"]
        assert r["minimum_tokens"] == minimum_prefill_tokens(prompts, args.block_size)
        assert r["computed_vs_minimum"] == pytest.approx(r["computed_tokens"] / r["minimum_tokens"])
        assert r["ttft_p50_ms"] > 0 and r["ttft_floor_ms"] > 0
    assert document["without"]["host_hit_tokens"] == document["without"]["disk_hit_tokens"] == 0
    assert document["host"]["host_hit_tokens"] > 0  # the evicted turns came back from the tier
    assert document["host"]["disk_hit_tokens"] == 0
    assert document["disk"]["disk_hit_tokens"] > 0  # most of them, from files in the disk way
    for way in ("host", "disk"):
        ratios = document["over_without"][way]
        for name in ("computed_tokens", "ttft_p50_ms", "ttft_p99_ms"):
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


def test_the_minimum_counts_blocks_once_in_order_and_a_fully_cached_prompt_as_one_token():
    block = 4
    first = list(range(8))  # two full blocks
    extended = first + [9, 9, 9, 9, 7]  # first's blocks cached, one new block, a tail of 1
    again = list(first)  # wholly cached: its last token runs again
    assert minimum_prefill_tokens([first, extended, again], block) == 8 + 4 + 1 + 1
    # Turn order: the earlier turn's last block is not cached yet when it runs.
    assert minimum_prefill_tokens([first, extended], block) == 8 + 5
