"""The router's index copy on the virtual cluster (VirtualIndex) and issue 50's tenants sweep."""

from __future__ import annotations

import json

from pdserve.bench.planner_validation import routing_offline
from pdserve.core.kv_events import KVEvent
from pdserve.planner.events import EventLoop
from pdserve.planner.virtual_index import VirtualIndex
from tests.bench.cli_args import bench_args


def test_a_steps_events_reach_the_index_its_lag_after_the_step_ends() -> None:
    loop = EventLoop()
    index = VirtualIndex(loop, lag_s=0.5)
    sink = index.sink("w0")
    sink([KVEvent("stored", [1, 2, 3], 48)])
    assert index.lookup([1, 2, 3]) == {}  # the step is still running
    index.step_ended("w0")
    seen = {}
    loop.at(0.4, lambda: seen.update(index.lookup([1, 2, 3])))
    loop.run(lambda: False)
    assert seen == {}  # 0.4 s after the step: not yet
    assert index.lookup([1, 2, 3, 4]) == {"w0": 3}
    index.sink("w1")([KVEvent("stored", [1, 2], 32)])
    sink([KVEvent("removed", [3], 16)])
    index.step_ended("w0")
    index.step_ended("w1")
    loop.run(lambda: False)
    assert index.lookup([1, 2, 3]) == {"w0": 2, "w1": 2}
    # (block, worker) entries: w0's 1 and 2, w1's 1 and 2 (w0's 3 went before w1's arrived).
    assert (index.entries, index.peak_entries, index.distinct_blocks) == (4, 4, 2)


def test_the_tenants_sweep_runs_six_policies_and_prefix_routing_hits(tmp_path, capsys) -> None:
    out = tmp_path / "tenants.json"
    args = bench_args(
        routing_offline, workload="tenants", models="llama-3.1-8b:1", sizes="4",
        rates_per_worker="2", tenant_kv_blocks=512, tenant_prefix_len=1024,
        users_per_tenant=2, tenant_turns=2, json=out,
    )  # fmt: skip
    assert routing_offline.run(args) == 0
    printed = capsys.readouterr().out
    assert "0.69x the cluster's KV, 2.8x one worker's" in printed
    results = {r["policy"]: r for r in json.loads(out.read_text())}
    assert set(results) == {
        "cost",
        "prefix",
        "approximate",
        "least_loaded",
        "round_robin",
        "random",
    }
    for r in results.values():
        assert r["completed"] + r["failed"] == r["requests"] > 0
        assert 0.0 <= r["hit_rate"] < 1.0
        assert r["goodput_tokens_per_s"] <= r["output_tokens_per_s"]
        # The index never holds more entries than the 4 workers' pools have blocks.
        assert 0 < r["index_peak_entries"] <= 4 * 512
        assert r["index_blocks_per_worker_s"] >= r["index_events_per_worker_s"] > 0
    # 22 tenants' prefixes on 4 workers: spreading them at random misses most of them.
    assert results["cost"]["hit_rate"] > results["random"]["hit_rate"] + 0.2
    assert results["prefix"]["hit_rate"] > results["random"]["hit_rate"] + 0.2


def test_router_replicas_each_route_their_share_on_the_same_workers_and_index(tmp_path) -> None:
    from pdserve.bench.planner_validation.routing_tenants import tenant_requests
    from pdserve.config import RouterConfig
    from pdserve.planner.deployment import Deployment
    from pdserve.planner.probe import SLO, Split, run_probe
    from pdserve.planner.workload import ProbeRequest

    args = bench_args(
        routing_offline, workload="tenants", tenant_prefix_len=1024, users_per_tenant=2,
        tenant_turns=2, router_replicas=3,
    )  # fmt: skip
    deployment = Deployment("llama-3.1-8b", gpu="h100", tp=1, num_kv_blocks=512)
    requests = tenant_requests(deployment, 6, args, seed=0)
    probes = [
        ProbeRequest(k, list(r.prompt), r.output_len, k * 0.1) for k, r in enumerate(requests)
    ]
    router = RouterConfig(policy="approximate", disaggregate="never")
    _, runs = run_probe(
        deployment, Split(0, 4), probes, 10.0, SLO(400, 40), router, stop_when_certain=False,
        index_lag_s=0.001, router_replicas=3,
    )  # fmt: skip
    cluster = runs[0].cluster
    assert len(cluster.routers) == 3 and len({id(r) for r in cluster.routers}) == 3
    for run in runs:
        assert run.routing is cluster.routers[run.probe.index % 3]
        assert run.record.ok
    for replica, routing in enumerate(cluster.routers):
        # One pool and one index for all; each replica routed (and remembers) only its share.
        assert routing.pool is cluster.pool and routing.index is cluster.index
        share = sum(1 for run in runs if run.probe.index % 3 == replica)
        assert sum(routing._prefills_routed.values()) == share
    held = [sum(r.approximate.held_blocks(w) for w in cluster.workers) for r in cluster.routers]
    assert all(held) and sum(held) > max(held)  # three partial views, none of them the whole


def test_the_tenants_sweep_in_closed_loop_reports_per_concurrency(tmp_path, capsys) -> None:
    out = tmp_path / "closed.json"
    args = bench_args(
        routing_offline, workload="tenants", models="llama-3.1-8b:1", sizes="2",
        concurrency="1,3", policies="cost,random", tenant_kv_blocks=512, tenant_prefix_len=1024,
        users_per_tenant=2, tenant_turns=2, json=out,
    )  # fmt: skip
    assert routing_offline.run(args) == 0
    printed = " ".join(capsys.readouterr().out.split())  # the console wraps long lines
    results = {(r["concurrency"], r["policy"]): r for r in json.loads(out.read_text())}
    assert set(results) == {(2, "cost"), (2, "random"), (6, "cost"), (6, "random")}
    for r in results.values():
        assert r["completed"] == r["requests"] == 11 * 2 * 2  # 11 tenants x 2 users x 2 turns
        assert r["rate"] > 0 and r["output_tokens_per_s"] > 0
    # Three times the clients, each waiting for its answers: more requests per second.
    assert results[6, "random"]["rate"] > 1.5 * results[2, "random"]["rate"]
    assert "2 workers, closed loop: 2 clients: output tok/s cost/random" in printed
    assert "target (>= 1.5) holds at" in printed


def test_the_tenants_sweep_takes_one_arrival_mode(capsys) -> None:
    both = bench_args(
        routing_offline, workload="tenants", sizes="2", concurrency="2", rates_per_worker="1"
    )
    assert routing_offline.run(both) == 2
    error = capsys.readouterr().err
    assert "--concurrency (closed loop) and --rates-per-worker (open loop)" in error
    assert "give one of them" in error
    for bad in ("0", "2,x"):
        wrong = bench_args(routing_offline, workload="tenants", sizes="2", concurrency=bad)
        assert routing_offline.run(wrong) == 2
        assert "--concurrency: clients per worker, positive integers" in capsys.readouterr().err
    wrong = bench_args(
        routing_offline, workload="tenants", sizes="2", concurrency="2", think_ms="-1"
    )
    assert routing_offline.run(wrong) == 2
    assert "--think-ms must be >= 0" in capsys.readouterr().err


def test_a_closed_loop_past_the_routers_admission_limit_is_admitted(tmp_path) -> None:
    # 300 clients on 264 one-turn conversations: all 264 pending at once, past the router's
    # default limit of 256, which would refuse 8 of them at once.
    out = tmp_path / "many.json"
    args = bench_args(
        routing_offline, workload="tenants", models="llama-3.1-8b:1", sizes="2",
        concurrency="150", policies="random", tenant_kv_blocks=512, tenant_prefix_len=1024,
        users_per_tenant=24, tenant_turns=1, json=out,
    )  # fmt: skip
    assert routing_offline.run(args) == 0
    (result,) = json.loads(out.read_text())
    assert result["requests"] == 264 and result["concurrency"] == 300
    assert result["failed"] == 0


def test_the_tenants_sweep_times_a_model_by_a_measured_profile(tmp_path, planner_model_dir):
    # A linear profile as `bench fidelity --profile-out` writes it, 1 ms of prefill a token:
    # a 512-token prefix computed cold takes at least half a second of simulated time.
    profile = tmp_path / "cpu.json"
    profile.write_text(json.dumps({"kind": "linear", "step_s": 1e-3, "prefill_token_s": 1e-3,
                                   "decode_seq_s": 1e-4, "context_token_s": 0.0}))  # fmt: skip
    out = tmp_path / "tenants.json"
    args = bench_args(
        routing_offline, workload="tenants", models=f"{planner_model_dir}:1", sizes="2",
        rates_per_worker="1", tenant_kv_blocks=128, tenant_prefix_len=512, users_per_tenant=2,
        tenant_turns=2, policies="cost,random", sim_profile=str(profile), json=out,
    )  # fmt: skip
    assert routing_offline.run(args) == 0
    results = {r["policy"]: r for r in json.loads(out.read_text())}
    assert all(r["failed"] == 0 for r in results.values())
    # The slowest tenth are cold prefixes: at the profile's rate, not an H100's few ms.
    assert all(r["ttft_p90_ms"] >= 500 for r in results.values())
