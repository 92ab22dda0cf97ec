"""Online planning: a window of served traffic and measured costs in, a split out — through the
child process the router runs (`python -m pdserve.planner.online`) and the router's
OnlinePlanner (router/online_plan.py)."""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys

import pytest
from prometheus_client import REGISTRY

from pdserve.core.messages import WorkerStats
from pdserve.models.builtin import default_model_dir
from pdserve.planner.online import MIN_REQUESTS, TrafficWindow, plan_window
from router.cost_model import CostModel
from router.online_plan import OnlinePlanner, PlanSettings
from router.traffic_window import ServedTraffic


def served_requests(count: int, rate: float, seed: int = 0) -> list[tuple[int, int, float]]:
    rng = random.Random(seed)
    now, requests = 100.0, []
    for _ in range(count):
        now += rng.expovariate(rate)
        requests.append((rng.randint(16, 120), rng.randint(4, 24), now))
    return requests


def window(**overrides) -> TrafficWindow:
    requests = overrides.pop("requests", served_requests(60, rate=4.0))
    fields = dict(
        model=str(default_model_dir()),
        workers=2,
        requests=requests,
        window_s=requests[-1][2] - requests[0][2],
        prefill_token_s=5e-5,
        step_s=4e-3,
        decode_seq_s=3e-4,
        num_kv_blocks=1024,
        ttft_slo_ms=500.0,
        tpot_slo_ms=50.0,
        requests_per_worker=30,
    )
    return TrafficWindow(**{**fields, **overrides})


def test_plan_window_chooses_among_every_split_of_the_live_workers():
    w = window()
    plan = plan_window(w)
    assert {s["split"] for s in plan["splits"]} == {"colocated 2", "1P:1D"}
    assert plan["recommended"] in {"colocated 2", "1P:1D"}
    assert plan["prefill_workers"] + plan["decode_workers"] == 2
    assert plan["goodput_rps"] > 0
    assert plan["observed_rps"] == pytest.approx(60 / w.window_s)
    assert plan["meets_observed"] == (plan["goodput_rps"] >= plan["observed_rps"])


def test_slower_measured_costs_predict_a_lower_goodput():
    fast = plan_window(window())
    slow = plan_window(window(step_s=0.04, decode_seq_s=3e-3, prefill_token_s=5e-4))
    assert slow["goodput_rps"] < fast["goodput_rps"]


def test_a_window_too_small_to_plan_is_refused():
    with pytest.raises(ValueError, match="need"):
        plan_window(window(requests=served_requests(MIN_REQUESTS - 1, rate=4.0)))


def run_child(text: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-m", "pdserve.planner.online"],
        input=text,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return json.loads(done.stdout)


def test_child_process_answers_json_and_names_what_is_wrong():
    assert "error" in run_child("{not json")
    assert "unexpected keyword" in run_child(json.dumps({"bogus": 1}))["error"]
    w = window()
    answer = run_child(json.dumps(w.__dict__))
    assert answer["recommended"] in {"colocated 2", "1P:1D"}


def test_router_planner_plans_its_served_traffic_and_exports_it():
    traffic = ServedTraffic()
    requests = served_requests(60, rate=4.0)
    shift = 1000.0  # the window ends "now": arrivals on the perf_counter clock of the test
    for prompt, output, at in requests:
        traffic.record(prompt, output, at + shift)
    stats = [
        WorkerStats(worker_id=f"w{i}", role="decode", epoch=1, num_blocks=1024) for i in range(2)
    ]
    published = []
    cost = CostModel()
    cost.decode.observe(8, 4e-3 + 8 * 3e-4)
    planner = OnlinePlanner(
        1e6,
        PlanSettings(str(default_model_dir()), 16, 64, 1024, "float32", 500.0, 50.0),
        cost,
        lambda: stats,
        traffic=traffic,
        publish=published.append,
    )
    sent = planner.window()
    assert sent["workers"] == 2 and len(sent["requests"]) == 60
    assert (sent["step_s"], sent["decode_seq_s"]) == cost.decode.coefficients
    plan = asyncio.run(planner.plan_once())
    assert "error" not in plan, plan
    assert planner.latest == plan and published == [plan]
    for role in ("prefill", "decode"):
        exported = REGISTRY.get_sample_value("pdserve_planner_workers", {"role": role})
        assert exported == plan[f"{role}_workers"]
    assert REGISTRY.get_sample_value("pdserve_planner_goodput_rps") == plan["goodput_rps"]


def test_router_planner_skips_a_window_without_traffic():
    planner = OnlinePlanner(
        60.0,
        PlanSettings(str(default_model_dir()), 16, 64, 1024, "float32", 500.0, 50.0),
        CostModel(),
        lambda: [WorkerStats(worker_id="w", role="decode", epoch=1, num_blocks=64)],
        traffic=ServedTraffic(),
    )
    assert asyncio.run(planner.plan_once()) is None
