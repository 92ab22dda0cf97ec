"""Closed-loop arrivals on the virtual cluster (pdserve/planner/closed_loop.py): clients that
wait for their answers, each owning whole conversations."""

from __future__ import annotations

import pytest

from pdserve.bench.planner_validation import routing_offline
from pdserve.bench.planner_validation.routing_tenants import tenant_requests
from pdserve.config import RouterConfig
from pdserve.planner.closed_loop import conversations_of, run_closed_loop
from pdserve.planner.cluster import RouterTiming
from pdserve.planner.deployment import Deployment
from pdserve.planner.probe import Split
from pdserve.planner.workload import ProbeRequest
from tests.bench.cli_args import bench_args


def _probes(deployment: Deployment, tenants: int, **workload) -> list[ProbeRequest]:
    args = bench_args(routing_offline, workload="tenants", **workload)
    requests = tenant_requests(deployment, tenants, args, seed=0)
    return [
        ProbeRequest(k, list(r.prompt), r.output_len, 0.0, r.tag) for k, r in enumerate(requests)
    ]


def _most_in_flight(runs) -> int:
    """The most requests between their send and their end at once (an end at the instant of a
    send frees its client first: the next request follows the answer)."""
    edges = [(r.record.send_time, 1) for r in runs] + [(r.record.end_time, -1) for r in runs]
    most = now = 0
    for _, step in sorted(edges):
        now += step
        most = max(most, now)
    return most


def _assert_conversations_in_order(runs, think_s: float) -> None:
    """Each conversation's turn k+1 is sent `think_s` after turn k ended, never before."""
    by_index = {r.probe.index: r for r in runs}
    for conversation in conversations_of([r.probe for r in runs]):
        turns = [by_index[p.index].record for p in conversation]
        for before, after in zip(turns, turns[1:], strict=False):
            assert after.send_time == pytest.approx(before.end_time + think_s, abs=1e-9)
            assert after.send_time >= before.end_time


@pytest.mark.parametrize("clients", [1, 3, 7])
def test_clients_wait_for_answers_and_serve_every_request_on_one_worker(clients: int) -> None:
    deployment = Deployment("llama-3.1-8b", gpu="h100", tp=1, num_kv_blocks=512)
    # 4 tenants x 2 users x 3 turns: 8 conversations, 24 requests.
    probes = _probes(deployment, 4, tenant_prefix_len=512, users_per_tenant=2, tenant_turns=3)
    assert len(conversations_of(probes)) == 8
    router = RouterConfig(policy="cost", disaggregate="never")
    runs, peak = run_closed_loop(
        deployment, Split(0, 1), probes, clients, router, think_s=0.005, index_lag_s=0.001
    )
    assert [r.probe for r in runs] == probes
    assert all(r.record.ok for r in runs)
    assert peak == _most_in_flight(runs) == clients  # every client busy at the start
    _assert_conversations_in_order(runs, think_s=0.005)
    # A client takes a new conversation only when its previous one is done: the first turns
    # after the first `clients` start as another conversation's last turn ended.
    ends = {r.record.end_time for r in runs}
    firsts = [r for r in runs if r.probe.index < 8]  # the workload's first round
    late = [r.record.send_time for r in firsts if r.record.send_time > 0]
    assert len(late) == 8 - clients
    assert all(any(t == pytest.approx(e + 0.005) for e in ends) for t in late)


def test_more_clients_than_conversations_run_each_conversation_once() -> None:
    deployment = Deployment("llama-3.1-8b", gpu="h100", tp=1, num_kv_blocks=512)
    probes = _probes(deployment, 2, tenant_prefix_len=256, users_per_tenant=2, tenant_turns=2)
    router = RouterConfig(policy="random", disaggregate="never")
    runs, peak = run_closed_loop(deployment, Split(0, 2), probes, 10, router)
    assert all(r.record.ok for r in runs)
    assert peak == _most_in_flight(runs) == 4  # 4 conversations, one turn of each at a time
    _assert_conversations_in_order(runs, think_s=0.0)


def test_a_failed_request_frees_its_client_and_its_conversation_goes_on() -> None:
    # One worker of 64 blocks (1,024 tokens) for 6 clients whose prompts hold 320-576 tokens:
    # requests that find it full wait 10 ms for room, then are refused, as live.
    deployment = Deployment("llama-3.1-8b", gpu="h100", tp=1, num_kv_blocks=64)
    probes = _probes(deployment, 2, tenant_prefix_len=256, users_per_tenant=3, tenant_turns=3)
    router = RouterConfig(policy="least_loaded", disaggregate="never")
    impatient = RouterTiming(room_wait_s=0.01, room_backoff_s=(0.005,))
    runs, peak = run_closed_loop(deployment, Split(0, 1), probes, 6, router, timing=impatient)
    assert all(r.ended for r in runs)
    failed = [r for r in runs if not r.record.ok]
    assert failed and len(failed) < len(runs)
    assert all(r.record.error.startswith("RESOURCE_EXHAUSTED") for r in failed)
    assert peak == _most_in_flight(runs) == 6
    _assert_conversations_in_order(runs, think_s=0.0)


def test_no_clients_is_refused() -> None:
    deployment = Deployment("llama-3.1-8b", gpu="h100", tp=1, num_kv_blocks=64)
    router = RouterConfig(policy="random", disaggregate="never")
    with pytest.raises(ValueError, match="clients must be >= 1"):
        run_closed_loop(deployment, Split(0, 1), [], 0, router)
