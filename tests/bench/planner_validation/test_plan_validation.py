"""`pdserve bench plan-validate` end to end on a small split: the planner's offline prediction
and a live cluster of sim workers (real Ray actors, router, Redis index, grpc handoffs) serve
the same requests, and agree within a loose bound (the bench's own figures: BENCHMARKS.md)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from pdserve.bench.planner_validation import plan_validate_bench as plan_validation_bench
from tests.bench.cli_args import bench_args
from tests.sim.conftest import LLAMA_8B_SHAPE, write_config_only_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return write_config_only_model(tmp_path_factory.mktemp("plan-validate-8b"), LLAMA_8B_SHAPE)


def _args(**overrides) -> argparse.Namespace:
    return bench_args(plan_validation_bench, **overrides)


# Live latencies against the plan's: another test worker's load moved the TTFT p90 ratio to
# 2.05 once in CI.
@pytest.mark.times_the_real_system
def test_rag_on_one_prefill_and_one_decode_worker_agrees_with_the_plan(
    ray_cluster, model_dir, tmp_path, capsys
):
    out = tmp_path / "result.json"
    args = _args(
        model=model_dir,
        scenarios="rag=1:1",
        requests=16,
        rate_fractions="0.5",
        extra_rates=0,  # one live rate: the sweep's bracketing is test_rates.py
        sim_time_scale=2,
        warmup_requests=2,
        # A loaded shared machine: the figures here are checked loosely, not refused.
        max_excess=1.0,
        max_overrun_fraction=1.0,
        json=out,
    )
    assert plan_validation_bench.run(args) == 0
    (result,) = json.loads(out.read_text())
    assert (result["prefill_workers"], result["decode_workers"]) == (1, 1)
    assert result["time_scale"] == 2.0
    planned, live = result["planned"], result["live"]
    assert planned["goodput"] > 0
    (planned_point,) = planned["points"]
    (live_point,) = live["points"]
    assert planned_point["rate"] == pytest.approx(0.5 * planned["goodput"])
    assert live_point["rate"] == planned_point["rate"]
    assert planned_point["completed"] == live_point["completed"] == 16
    # Same requests, same arrivals, same scheduler and router: the latencies agree loosely.
    (ratio,) = result["ratios"]["points"]
    assert 0.5 <= ratio["ttft_p90"] <= 2.0, (planned_point, live_point)
    assert 0.5 <= ratio["tpot_p90"] <= 2.0, (planned_point, live_point)
    printed = capsys.readouterr().out
    assert "| rag | 1P:1D | 2 |" in printed and "planned goodput" in printed


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("chat=0:2", [("chat", 0, 2, False)]),
        ("rag=1:1, mixed=1:2", [("rag", 1, 1, False), ("mixed", 1, 2, False)]),
        ("mixed=hybrid:2", [("mixed", 0, 2, True)]),
    ],
)
def test_scenario_specs(spec, expected):
    assert plan_validation_bench.parse_scenarios(spec) == expected


@pytest.mark.parametrize("spec", ["chat", "chat=2", "sharegpt=1:1", "chat=1:0", "rag=-1:2"])
def test_bad_scenarios_are_one_line_on_stderr_and_exit_status_2(spec, capsys):
    assert plan_validation_bench.run(_args(scenarios=spec)) == 2
    err = capsys.readouterr().err
    assert err.startswith("pdserve bench: error: --scenarios") and err.count("\n") == 1
