"""`pdserve bench control-plane` at small scale: 16 workers, 20k blocks, the same code path.

Real redis-server, real sim engines publishing through PrefixIndexPublisher / IndexFeeder, the
router's real Routing over a real WorkerPool; the report's figures are checked against each
other and against the plan they were built from.
"""

from __future__ import annotations

import argparse
import json

import pytest

from pdserve.bench.control_plane import control_plane_bench
from pdserve.bench.control_plane.control_plane_workload import IndexPlan, PlanSettings, probes


def bench_args(tmp_path, *extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    control_plane_bench.add_arguments(parser)
    return parser.parse_args(
        [
            "--workers", "16", "--prefill-workers", "4", "--blocks", "20000",
            "--system-prompts", "8", "--pair-decisions", "200", "--concurrency", "4",
            "--events-seconds", "1", "--disaggregate", "auto", "--decode-batch", "8", "--prefill-tok-s", "20000",
            "--churn-blocks-per-s", "5000",
            "--json", str(tmp_path / "report.json"), *extra,
        ]
    )  # fmt: skip


def test_small_index_report_is_consistent(tmp_path, capsys) -> None:
    assert control_plane_bench.run(bench_args(tmp_path)) == 0
    report = json.loads((tmp_path / "report.json").read_text())
    idx, (by_redis, mirrored) = report["index"], report["routing"]
    # Every block the engines stored is in Redis, none was evicted, and the plan agrees.
    assert idx["distinct_blocks"] == idx["planned_distinct_blocks"] >= 20_000
    assert idx["entries"] == idx["stored_blocks_published"] == idx["planned_entries"]
    assert idx["entries"] > idx["distinct_blocks"]  # shared prefixes are held by several
    assert idx["removed_blocks_published"] == 0 and idx["failed_publishes"] == 0
    assert 50 < idx["bytes_per_block"] < 2000
    assert (by_redis["lookup"], mirrored["lookup"]) == ("redis", "mirror")
    for rt in (by_redis, mirrored):
        # Every lookup found exactly the workers holding each prompt's prefixes, with their
        # lengths, from Redis and from the router's copy.
        assert rt["decisions"] == 200 and rt["lookup_mismatches"] == 0
        assert 0 < rt["lookup_ms"]["p50"] <= rt["decision_ms"]["p99"]
        assert rt["decisions_per_s"] > 0 and rt["decisions_per_s_concurrent"] > 0
        assert rt["prompts_with_holder"] > 150  # 90% of the prompts share a cached prefix
        assert rt["with_events"]["blocks_per_s"] > 1000  # decisions timed again, events flowing
        assert rt["with_events"]["decision_ms"]["count"] == 200
        waits = rt["with_events"]["decision_wait_ms"]  # wall minus the router thread's CPU
        assert waits["count"] == 200
    # The copy was built from Redis, followed the events and asked Redis nothing per lookup.
    assert by_redis["mirror"] is None and mirrored["mirror"]["build_s"] > 0
    assert mirrored["with_events"]["mirror_events_per_s"] > 10
    assert mirrored["redis_cpu_per_lookup_ms"] < by_redis["redis_cpu_per_lookup_ms"]
    for role in ("prefill", "decode"):
        pub = report["publishing"][role]
        assert pub["blocks_per_s"] > 0 and pub["commands_per_s"] > 0 and pub["bytes_in_per_s"] > 0
    mem = report["memory"]
    assert mem["redis_peak_rss_mb"] > 0 and mem["router_process_peak_rss_mb"] > 0
    assert "Control plane: 16 workers" in capsys.readouterr().out


@pytest.mark.parametrize("layout", ["conversations", "tenants"])
def test_probes_expect_the_longest_prefix_on_the_conversations_holders(layout) -> None:
    plan = IndexPlan.build(
        PlanSettings(workers=8, prefill_workers=2, target_blocks=3000, layout=layout)
    )
    assert plan.distinct_blocks >= 3000
    conversations = {tuple(plan.conversation_tokens(c)): c for c in plan.conversations}
    checked = 0
    for probe in probes(plan, 50):
        assert len(probe.prompt) == plan.settings.prompt_tokens
        if probe.kind != "continue":
            continue
        best = max(probe.expected.values())
        cached = tuple(probe.prompt[: best * plan.settings.block_size])
        conv = conversations[cached]
        assert {w for w, n in probe.expected.items() if n == best} == {
            plan.worker_id(w) for w in conv.holders
        }
        checked += 1
    assert checked > 20


def tenants_plan(workers: int = 32) -> IndexPlan:
    return IndexPlan.build(
        PlanSettings(
            workers=workers,
            prefill_workers=4,
            target_blocks=6000,
            system_prompts=40,
            system_tokens=512,
            prompt_tokens=768,
            min_history_tokens=32,
            layout="tenants",
        )
    )


def test_a_tenants_conversations_stay_on_its_few_home_workers() -> None:
    plan = tenants_plan()
    homes: dict[int, set[int]] = {}
    users: dict[int, int] = {}
    for conv in plan.conversations:
        homes.setdefault(conv.system, set()).update(conv.holders)
        users[conv.system] = users.get(conv.system, 0) + 1
    assert max(map(len, homes.values())) <= 3  # a prefix is where its users are, not everywhere
    assert sum(users.values()) / len(users) > 2  # several users per tenant
    # So the index holds each block on ~1.5 workers, not on every worker with one of its users.
    entries = sum(plan.held_blocks(w) for w in range(plan.settings.workers))
    assert plan.distinct_blocks <= entries < 2 * plan.distinct_blocks


def test_bulk_fill_leaves_the_index_the_engines_events_leave() -> None:
    import redis

    from pdserve.bench.control_plane.control_plane_fill import (
        MODEL_NAME,
        bulk_fill_index,
        fill_index,
    )
    from pdserve.prefix_index.redis_server import RedisServer
    from pdserve.prefix_index.schema import IndexKeys

    plan = tenants_plan(workers=6)
    keys = IndexKeys(MODEL_NAME)
    held = []
    for bulk in (True, False):
        with RedisServer() as server:
            if bulk:
                fills = bulk_fill_index(plan, server.url)
            else:
                fills, _ = fill_index(plan.settings, server.url, processes=1)
            assert sum(f.failed_publishes for f in fills) == 0
            client = redis.Redis.from_url(server.url, decode_responses=True)
            held.append([client.smembers(keys.worker_blocks(plan.worker_id(w))) for w in range(6)])
            assert client.exists(keys.heartbeat(plan.worker_id(5)))  # live, for the router
            client.close()
    by_bulk, by_events = held
    assert by_bulk == by_events
    assert [len(h) for h in by_bulk] == [plan.held_blocks(w) for w in range(6)]


def test_impossible_split_is_a_one_line_error(tmp_path) -> None:
    with pytest.raises(SystemExit, match="prefill_workers"):
        control_plane_bench.run(bench_args(tmp_path, "--prefill-workers", "16"))
    with pytest.raises(SystemExit, match="--disaggregate"):
        control_plane_bench.run(bench_args(tmp_path, "--disaggregate", "sometimes"))
    with pytest.raises(SystemExit, match="--lookup"):
        control_plane_bench.run(bench_args(tmp_path, "--lookup", "memcached"))


@pytest.mark.parametrize("policy", ["approximate", "random", "prefix"])
def test_every_routing_policy_can_be_timed(tmp_path, policy) -> None:
    assert bench_args(tmp_path, "--policy", policy).policy == policy
