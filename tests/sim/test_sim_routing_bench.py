"""`pdserve bench sim-routing` end to end on four sim workers: the report's structure and its
numbers' consistency (computed vs minimum prompt tokens, ratios), not the targets."""

from __future__ import annotations

import argparse
import json

import pytest

from pdserve.bench.planner_validation import routing_offline
from pdserve.bench.simulation import sim_routing_bench
from pdserve.core.sampling_params import SamplingParams
from tests.bench.cli_args import bench_args


def _args(**overrides) -> argparse.Namespace:
    return bench_args(sim_routing_bench, **overrides)


def test_two_policies_on_four_workers_report_consistent_figures(
    ray_cluster, sim_model_dir, tmp_path, capsys
):
    out = tmp_path / "result.json"
    args = _args(
        model=sim_model_dir,
        sizes=4,
        policies="round_robin,cost",
        rate_per_worker=4,
        conversations_per_worker=2,
        turns=2,
        system_prompts=2,
        system_prompt_len=64,
        user_len=16,
        output_len=6,
        block_size=4,
        num_kv_blocks=4096,
        sim_time_scale=3,
        max_excess=1.0,
        max_overrun_fraction=1.0,
        json=out,
    )
    assert sim_routing_bench.run(args) == 0
    results = json.loads(out.read_text())
    assert [(r["size"], r["policy"]) for r in results] == [(4, "round_robin"), (4, "cost")]
    for r in results:
        assert r["completed"] == 16 and r["failed"] == 0
        # Turn 2 repeats turn 1's prompt: some prompt is shared, so the minimum is well below
        # the prompt total, and no routing computes less than the minimum.
        assert r["minimum_tokens"] < 0.5 * r["prompt_tokens"]
        assert r["minimum_tokens"] <= r["computed_tokens"] <= r["prompt_tokens"]
        assert r["computed_vs_minimum"] == pytest.approx(r["computed_tokens"] / r["minimum_tokens"])
        assert 0 < r["ttft_p50_ms"] <= r["ttft_p99_ms"]
        assert 0 < r["tpot_p50_ms"] <= r["tpot_p99_ms"]
    # Round-robin always disaggregates when it may.
    assert results[0]["local_prefills"] == 0.0
    printed = capsys.readouterr().out
    assert "4 workers, cost vs round-robin: TTFT p50" in printed


def test_offline_runs_every_policy_on_the_virtual_cluster_without_ray(sim_model_dir, tmp_path):
    # 64 workers in seconds: the planner's virtual cluster, no actors. Prefix affinity computes
    # the minimum; round-robin, blind to prefixes, several times it.
    out = tmp_path / "offline.json"
    args = _args(
        model=sim_model_dir,
        sizes=64,
        conversations_per_worker=1,
        turns=2,
        system_prompts=4,
        system_prompt_len=256,
        user_len=32,
        output_len=8,
        json=out,
    )
    assert routing_offline.run(args) == 0
    results = {r["policy"]: r for r in json.loads(out.read_text())}
    assert list(results) == list(sim_routing_bench.POLICIES)
    for r in results.values():
        assert r["completed"] == 128 and r["failed"] == 0
        assert r["minimum_tokens"] <= r["computed_tokens"] <= r["prompt_tokens"]
        assert r["router_busy"] is None and r["max_step_excess"] is None
    assert results["prefix"]["computed_tokens"] == results["prefix"]["minimum_tokens"]
    assert results["round_robin"]["computed_vs_minimum"] > 2
    assert results["round_robin"]["local_prefills"] == 0.0


def test_minimum_counts_new_blocks_tails_and_a_recomputed_last_token(make_sim_engine):
    system = list(range(10, 18))  # two blocks of 4
    first = system + [40, 41, 42, 43]  # 3 blocks, all new
    second = first + [50, 51]  # extends it: 2 tail tokens only
    again = list(first)  # every block seen: its last token runs again
    other = system + [60]  # one tail token after the shared system prompt
    prompts = [first, second, again, other]
    assert sim_routing_bench.minimum_prefill_tokens(prompts, 4) == 12 + 2 + 1 + 1
    # One engine (block size 4) serving them in this order computes that, but for the fully
    # cached prompt, whose whole last block it recomputes (3 tokens more than the one needed).
    engine = make_sim_engine(num_kv_blocks=64)
    for prompt in prompts:
        engine.generate([prompt], [SamplingParams(max_tokens=1)])
    assert engine.stats()["prefill_tokens_computed"] == 16 + 3


def test_split_keeps_one_worker_in_each_pool():
    assert sim_routing_bench.split(16, 0.25) == (4, 12)
    assert sim_routing_bench.split(64, 0.25) == (16, 48)
    assert sim_routing_bench.split(2, 0.01) == (1, 1)
    assert sim_routing_bench.split(2, 0.99) == (1, 1)
