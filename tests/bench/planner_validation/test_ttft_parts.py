"""TTFT parts of an offline probe's disaggregated requests: they add up to the TTFT, the push
(after the first token) takes the modelled link's time for the blocks sent and the commit's
wait, and both sides compare by request index."""

from __future__ import annotations

import pytest

from pdserve.bench.planner_validation.ttft_parts import (
    compare,
    first_routed_apart,
    live_parts,
    offline_parts,
    parts_line,
)
from pdserve.config import RouterConfig
from pdserve.planner.deployment import Deployment
from pdserve.planner.probe import SLO, Split, run_probe
from pdserve.planner.workload import PlanRequest, probe_sample
from pdserve.workloads.metrics import RequestRecord


@pytest.fixture(scope="module")
def disaggregated_runs(validation_model_dir):
    deployment = Deployment(
        str(validation_model_dir), max_num_seqs=8, max_num_batched_tokens=256, num_kv_blocks=512
    )
    requests = [PlanRequest(200 + 37 * i, 4) for i in range(12)]
    sample = probe_sample(requests, len(requests), seed=1)
    router = RouterConfig(disaggregate="always", ttft_slo_ms=1e6, tpot_slo_ms=1e6)
    _, runs = run_probe(
        deployment, Split(1, 1), sample, 20.0, SLO(1e6, 1e6), router, stop_when_certain=False
    )
    return deployment, runs


def test_offline_parts_add_up_to_the_ttft_and_the_push_takes_the_link_time(disaggregated_runs):
    deployment, runs = disaggregated_runs
    parts = offline_parts(runs)
    assert sorted(parts) == [run.record.index for run in runs]
    assert all(p["local"] == 0.0 for p in parts.values())  # disaggregate="always"
    bytes_per_block = runs[0].cluster.workers["prefill-0"].engine.bytes_per_block
    commit_waits = []
    for run in runs:
        p = parts[run.record.index]
        assert p["queue"] + p["prefill"] + p["handoff"] == pytest.approx(p["ttft"])
        assert p["client"] == 0.0 and p["handoff"] >= -1e-9 and p["prefill"] > 0.0
        # every block of the prompt, the partial last one too, is pushed (none is cached on
        # the decode worker), then the commit waits for the decode worker's step in progress
        link_ms = (
            -(-len(run.probe.prompt) // 16) * bytes_per_block / deployment.link_bytes_per_s * 1e3
        )
        commit_waits.append(p["transfer"] - link_ms)
    assert min(commit_waits) == pytest.approx(0.0, abs=1e-9)  # the first found it idle
    assert all(wait >= -1e-9 for wait in commit_waits) and max(commit_waits) > 0


def test_live_parts_convert_wall_server_timings_and_compare_by_index():
    scale = 10.0
    record = RequestRecord(3, "r3", 100, 3, send_time=1.0, chunk_times=[1.2, 1.21, 1.22])
    record.chunk_tokens = [1, 1, 1]
    record.ok = True
    record.server_timings = {
        "queue_ms": 100.0, "prefill_ms": 800.0, "transfer_ms": 300.0, "ttft_ms": 1500.0,
        "disaggregated": True,
    }  # fmt: skip
    local = RequestRecord(4, "r4", 100, 3, chunk_times=[0.1], ok=True)
    local.server_timings = {"prefill_ms": 600.0, "ttft_ms": 900.0, "disaggregated": False}
    parts = live_parts([record, local], scale)
    assert sorted(parts) == [3, 4] and (parts[3]["local"], parts[4]["local"]) == (0.0, 1.0)
    # a local prefill's TTFT is not split: it is the router's (and the client's hops)
    assert parts[4]["prefill"] == 0.0 and parts[4]["handoff"] == pytest.approx(90.0)
    assert parts[3]["queue"] == pytest.approx(10.0)
    assert parts[3]["handoff"] == pytest.approx(60.0)  # 150 - 10 - 80: the push comes after
    assert parts[3]["client"] == pytest.approx(50.0)  # the client's 200 ms less the router's 150
    assert parts[3]["tpot"] == pytest.approx(10.0)
    planned = {3: dict(parts[3], queue=5.0), 4: dict(parts[4], local=0.0), 7: parts[3]}
    count, means = compare(planned, parts)
    assert count == 1 and means["queue"] == pytest.approx((5.0, 10.0))
    assert compare(planned, parts, local=True) == (0, {})  # request 4 was routed differently
    assert "over 1 disaggregated on both" in parts_line(planned, parts)
    assert first_routed_apart(planned, parts) == (4, 1)
    assert parts_line(planned, parts).startswith("1 routed apart, first request 4; ")
    assert first_routed_apart(parts, parts) == (None, 0)
    assert parts_line(parts, parts).startswith("all routed alike; ")
    assert compare({}, parts) == (0, {})
