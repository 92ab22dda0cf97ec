"""The compute ceiling: a lower bound on the work a sample costs, and the plan's warning when a
goodput lies above it."""

from __future__ import annotations

import pytest

from pdserve.config import RouterConfig
from pdserve.core.prompt_tokens import PromptTokens
from pdserve.planner.ceiling import compute_ceiling
from pdserve.planner.deployment import Deployment
from pdserve.planner.probe import SLO, Split, run_probe
from pdserve.planner.report import plan_table
from pdserve.planner.search import Plan, SplitResult
from pdserve.planner.workload import PlanRequest, ProbeRequest, probe_sample


@pytest.mark.parametrize("split", [Split(0, 2), Split(1, 1)])
def test_the_workers_busy_time_is_at_least_the_ceilings_compute(planner_model_dir, split):
    deployment = Deployment(str(planner_model_dir), max_num_batched_tokens=512)
    requests = [PlanRequest(300 + 97 * i, 3 + i % 7) for i in range(16)]
    sample = probe_sample(requests, len(requests), seed=4)
    router = RouterConfig(ttft_slo_ms=1e6, tpot_slo_ms=1e6)
    _, runs = run_probe(
        deployment, split, sample, 50.0, SLO(1e6, 1e6), router, stop_when_certain=False
    )
    assert all(run.record.ok for run in runs)
    busy = sum(w.busy_seconds for w in runs[0].cluster.workers.values())
    # The whole sample's compute on one worker is len(sample) / ceiling(1 worker).
    compute = len(sample) / compute_ceiling(deployment, sample, workers=1)
    # Every step also reads the weights and pays its overhead, so busy time is longer.
    assert compute <= busy
    assert compute > 0.3 * busy  # the prompts are compute-bound: the bound is not vacuous


def test_the_plan_names_the_goodputs_above_the_ceiling():
    fast, slow = SplitResult(Split(0, 2), 10.0), SplitResult(Split(1, 1), 10.0)
    fast.goodput, slow.goodput = 120.0, 80.0
    plan = Plan([fast, slow], precision=0.05, seconds=1.0, probes=2)
    context = {
        "model": "m", "gpus": 2, "gpu": "h100", "tp": 1, "profile": "analytical:h100",
        "workload": "chat", "requests": 10, "requests_per_worker": 5, "ttft_slo_ms": 400,
        "tpot_slo_ms": 40, "attainment": 0.9, "compute_ceiling": 100.0,
    }  # fmt: skip
    table = plan_table(plan, context, top=2)
    assert "compute ceiling: 100.00 req/s" in table
    assert "above the ceiling, so not sustainable: colocated 2 (" in table
    assert "compute ceiling" not in plan_table(plan, {**context, "compute_ceiling": None}, 2)


def test_a_prefix_earlier_prompts_share_is_not_counted_again():
    """Agentic sessions resend a long context: a cache could serve it, so it bounds nothing."""
    deployment = Deployment("llama-3.1-8b", gpu="h100")
    context = list(range(1, 1025))  # 64 blocks of 16 tokens

    def sample(shared: bool) -> list[ProbeRequest]:
        prompts = [
            (context if shared else [t + 2000 * (i + 1) for t in context]) + [9000 + i] * 16
            for i in range(20)
        ]
        return [ProbeRequest(i, PromptTokens(p), 8, float(i)) for i, p in enumerate(prompts)]

    distinct, sharing = (compute_ceiling(deployment, sample(s), workers=1) for s in (False, True))
    # 20 x 1040 prompt tokens against 1040 + 19 x 16: the prompts' FLOPs dominate.
    assert sharing > 5 * distinct
