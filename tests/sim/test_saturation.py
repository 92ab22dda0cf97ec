"""The sim benchmarks refuse figures from a saturated CPU (issue 14 point 4): a time scale far
too small for the load is refused with a line naming the workers and a scale to try; a
comfortable one is accepted, and its latencies are reported in simulated time."""

from __future__ import annotations

import argparse

import pytest

from pdserve.bench.simulation.sim_run import (
    SimCluster,
    run_sim_load,
    serve_sim,
    wait_idle,
)
from pdserve.bench.simulation.sim_saturation import (
    Saturated,
    SaturationCheck,
    WorkerPace,
    checked_run,
)
from pdserve.workloads.datasets import BenchRequest
from pdserve.workloads.metrics import RequestRecord


def _requests(count: int, prompt_len: int, output_len: int) -> list[BenchRequest]:
    return [
        BenchRequest([5 + (i * 7 + j) % 900 for j in range(prompt_len)], prompt_len, output_len)
        for i in range(count)
    ]


def _run(model_dir, time_scale: float, requests, rate: float, max_excess: float):
    cluster = SimCluster(
        prefill_workers=1,
        decode_workers=1,
        time_scale=time_scale,
        block_size=4,
        num_kv_blocks=2048,
        disaggregate="always",
    )
    with (
        serve_sim(model_dir, cluster) as app,
        SaturationCheck(app, time_scale, max_excess=max_excess) as check,
    ):
        records = run_sim_load(app, requests, rate, time_scale)
        wait_idle(app)
    return check, records


def test_a_time_scale_far_too_small_is_refused_after_its_retries(ray_cluster, sim_model_dir):
    # A decode step of Llama-3.1-8B on an H100 is ~7 ms; at 1/2000 of it no Python step keeps up.
    scale = 0.0005
    cluster = SimCluster(
        prefill_workers=1,
        decode_workers=1,
        time_scale=scale,
        block_size=4,
        num_kv_blocks=2048,
        disaggregate="always",
    )
    args = argparse.Namespace(
        sim_time_scale=scale, max_excess=0.05, max_overrun_fraction=0.01, retries=1
    )
    attempts: list[int] = []

    def run_once(attempt: int):
        attempts.append(attempt)
        return run_sim_load(app, _requests(6, 64, 24), 1000.0, scale)

    with serve_sim(sim_model_dir, cluster) as app, pytest.raises(Saturated) as refused:
        checked_run(app, args, run_once, "tiny scale")
    assert attempts == [0, 1]  # refused, run once more, refused again
    line = str(refused.value)
    assert "\n" not in line and line.startswith("tiny scale: refusing to report")
    assert "--sim-time-scale 0.0005" in line and "overrun steps" in line
    suggested = float(line.rsplit("try --sim-time-scale ", 1)[1].rstrip(")"))
    assert suggested >= 2 * scale


def test_a_comfortable_time_scale_is_accepted_in_simulated_time(ray_cluster, sim_model_dir):
    scale = 10.0
    check, records = _run(sim_model_dir, scale, _requests(3, 32, 6), 20.0, max_excess=0.5)
    assert check.verdict() is None, check.verdict()
    check.check()
    assert all(w.modelled_s > 0 and w.overrun_steps == 0 for w in check.workers)
    assert all(r.ok and r.output_tokens == 6 for r in records)
    # Simulated time: a decode step is modelled at ~7 ms (+ queueing behind the others' few
    # steps), so simulated TPOT is tens of milliseconds although each wall step lasts 10x that.
    tpots = [r.tpot for r in records]
    assert all(0.005 < t < 0.05 for t in tpots), tpots


def test_the_suggested_scale_covers_the_worst_excess():
    check = SaturationCheck(app=None, time_scale=4.0)
    check.workers = [WorkerPace("decode-0", 1.0, 7.5, 0), WorkerPace("prefill-0", 1.0, 1.01, 0)]
    assert check.problems() == ["decode-0 steps +650% over modelled"]
    assert check.suggested_scale() == 50.0  # 4 x 7.5 = 30, rounded up to 50
    check.workers = [WorkerPace("decode-0", 1.0, 1.02, 0)]
    check.router_busy = 0.95
    assert check.problems() == ["router process 95% of a core busy"]
    assert check.suggested_scale() >= 8.0


def test_failures_other_than_admission_control_are_saturation():
    check = SaturationCheck(app=None, time_scale=4.0)
    records = [
        RequestRecord(0, "a", 8, 4, ok=True),
        RequestRecord(1, "b", 8, 4, ok=False, error_code="RESOURCE_EXHAUSTED"),
        RequestRecord(2, "c", 8, 4, ok=False, error_code="UNAVAILABLE"),
        RequestRecord(3, "d", 8, 4, ok=False, error_code="UNAVAILABLE"),
    ]
    check.note_failures(records)
    assert check.problems() == ["requests failed (2 UNAVAILABLE)"]
    assert "requests failed (2 UNAVAILABLE)" in check.verdict()


def test_rare_overrun_steps_are_tolerated_frequent_ones_are_not():
    check = SaturationCheck(app=None, time_scale=4.0, max_overrun_fraction=0.01)
    check.workers = [WorkerPace("decode-0", 1.0, 1.0, overrun_steps=2, decode_steps=500)]
    assert check.verdict() is None
    check.workers = [WorkerPace("decode-0", 1.0, 1.0, overrun_steps=6, decode_steps=500)]
    assert check.problems() == ["decode-0 steps +0% over modelled, 6 overrun steps"]
