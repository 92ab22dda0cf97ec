"""`pdserve bench router-tenants` at its smallest: two real systems (tiny model, 2 colocated
workers, Redis index) serving the same tenants' requests under the cost policy and random."""

from __future__ import annotations

import json

import pytest

from pdserve.bench.serving import tenants_bench
from tests.bench.cli_args import bench_args

SMALLEST = {
    "preset": "tiny",
    "kv_blocks": 64,
    "tenant_prefix_len": 256,
    "users_per_tenant": 2,
    "tenant_turns": 2,
    "rate": 8,
    "policies": "cost,random",
}


def test_both_policies_serve_every_request_and_the_prefix_aware_one_computes_less(
    ray_cluster, tmp_path, capsys
):
    path = tmp_path / "tenants.json"
    args = bench_args(tenants_bench, json=path, **SMALLEST)
    assert tenants_bench.run(args) == 0
    document = json.loads(path.read_text())
    # 0.7 x 2 workers x 64 blocks over 16-block prefixes: 6 tenants (1.5x one worker's KV).
    assert document["settings"]["tenants"] == 6 and document["settings"]["requests"] == 24
    results = {r["policy"]: r for r in document["results"]}
    for r in results.values():
        assert r["failed"] == 0 and r["completed"] == 24
        # Every prompt token was either computed or found in a worker's cache.
        assert r["computed_tokens"] + r["cached_tokens"] == r["prompt_tokens"]
        assert 0 < r["ttft_p50_ms"] <= r["ttft_p90_ms"]
    # Routing by the index sends a tenant's users where its prefix is cached; random does not.
    assert results["cost"]["computed_tokens"] < results["random"]["computed_tokens"]
    assert results["cost"]["hit_rate"] > results["random"]["hit_rate"]
    assert set(document["ranking"]) == {"cost", "random"}
    assert "ranking by TTFT p90" in capsys.readouterr().out


def test_an_unknown_policy_is_refused_by_name():
    with pytest.raises(SystemExit, match="--policies: unknown fastest"):
        tenants_bench.run(bench_args(tenants_bench, policies="cost,fastest"))
