"""A local prefill in the simulated cluster tells its router when the prompt is computed, as the
live router's request flow does: the worker's queue stops holding it then, not at the next stats
poll (0.25 s later, two 8B prefills of 4096 tokens on an H100), so the cost policy's queue
estimates in colocated simulations are the live router's."""

from __future__ import annotations

from pdserve.config import RouterConfig
from pdserve.planner.deployment import Deployment
from pdserve.planner.probe import SLO, Split, run_probe
from pdserve.planner.workload import ProbeRequest

FIRST = [3 + i % 400 for i in range(4096)]
SECOND = [5 + i % 300 for i in range(4096)]  # shares no block with the first


def test_a_computed_local_prefill_no_longer_queues_on_its_worker() -> None:
    deployment = Deployment("llama-3.1-8b", num_kv_blocks=1024, block_size=16)
    # The second arrives after the first's prompt is computed (~0.11 s), before the next poll.
    probes = [ProbeRequest(0, FIRST, 8, 0.0), ProbeRequest(1, SECOND, 8, 0.15)]
    router = RouterConfig(policy="cost", disaggregate="never")
    _, runs = run_probe(
        deployment, Split(0, 1), probes, 1.0, SLO(1e4, 1e4), router, stop_when_certain=False
    )
    first, second = runs
    assert all(r.record.ok for r in runs)
    assert first.record.ttft < 0.15  # computed before the second came
    estimate = second.route.estimate
    # No wait priced: its TTFT is its own prefill's (the first's prompt was still counted).
    assert estimate.prefill_worker is None and estimate.ttft_s == estimate.compute_s
