"""`pdserve bench fidelity` end to end on the tiny model: calibration inside real CPU workers,
then an evaluation workload the profile was not fitted on, served twice by the real system
around one sim run: sim/real latencies within a looser bound than the benchmark's ±20% (few
requests, a shared machine), and the printed bands the real runs' min-max. Runs the command
in a subprocess: it starts its own local Ray, and Ray allows one per process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.bench.simulation.fidelity_bench import METRICS, ratios
from pdserve.bench.simulation.fidelity_eval import band, parse_eval_workloads, run_order
from pdserve.sim.fit import fit_transfer

REPO_ROOT = Path(__file__).resolve().parents[2]
BOUND = 0.5  # sim/real p50 within 1 ± this


@pytest.mark.times_the_real_system
def test_sim_workers_reproduce_the_real_cpu_system_within_the_bound(tmp_path):
    out = tmp_path / "fidelity.json"
    profile = tmp_path / "profile.json"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    command = [
        sys.executable,
        "-m",
        "pdserve.cli",
        "bench",
        "fidelity",
        "--preset",
        "tiny",
        "--rates",
        "4",
        "--num-requests",
        "16",
        "--mixed-long-input-len",
        "512",
        "--eval-workloads",
        "short",
        "--real-repeats",
        "2",
        "--profile-out",
        str(profile),
        "--json",
        str(out),
    ]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert json.loads(profile.read_text())["kind"] == "linear"
    assert result["profile"]["device"] == "cpu"
    assert result["link_gbps"] > 0
    runs = result["real_repeats"]["short"]
    assert len(runs) == 2 and result["real"]["short"] == runs[0]
    for summary in (*runs, result["sim"]["short"]):
        assert summary["completed"] == 16
    _check_printed_bands(done.stdout, result)
    measured = result["ratios"]["short"]
    assert measured == ratios(result["real"]["short"], result["sim"]["short"])
    for key in ("ttft_p50", "tpot_p50"):
        assert abs(measured[key] - 1) <= BOUND, (key, measured, done.stdout[-3000:])


def _check_printed_bands(stdout: str, result: dict) -> None:
    """Each printed band row: lo and hi the min and max of the two real runs, the sim's figure,
    and ok exactly when the sim lies in [lo / 1.1, hi x 1.1]; the count line agrees."""
    runs, sim = result["real_repeats"]["short"], result["sim"]["short"]
    table = stdout[stdout.index("real band over 2 real runs") :]
    rows = [
        [cell.strip() for cell in line.split("│")[1:-1]]
        for line in table.splitlines()
        if line.startswith("│") and "short" in line
    ]
    assert len(rows) == len(METRICS), table
    within = 0
    for (metric, pct), row in zip(METRICS, rows, strict=True):
        real = [run[metric][pct] for run in runs]
        lo, hi, figure = min(real), max(real), sim[metric][pct]
        ok = lo / 1.1 <= figure <= hi * 1.1
        within += ok
        expected = ["short", "6", f"{metric.upper()} {pct}", f"{lo:.2f}", f"{hi:.2f}"]
        assert row == [*expected, f"{figure:.2f}", "ok" if ok else "OFF"], (row, real, figure)
    assert f"widened by 10%: {within} of 4" in table
    assert result["within_band"] == {"within": within, "of": 4}


def test_the_band_is_the_real_runs_min_max_widened_by_a_tenth():
    assert band([100.0, 120.0], 131.9)["within"] and not band([100.0, 120.0], 132.1)["within"]
    assert band([120.0, 100.0], 91.0)["within"] and not band([120.0, 100.0], 90.9)["within"]
    assert band([120.0, 100.0], 91.0) == {"lo": 100.0, "hi": 120.0, "sim": 91.0, "within": True}


def test_the_sims_run_amid_the_real_repeats():
    assert run_order(["real", "sim"], 1) == ["real", "sim"]
    assert run_order(["real", "sim"], 2) == ["real", "sim", "real"]
    assert run_order(["real", "sim", "sim_mean"], 3) == ["real", "real", "sim", "sim_mean", "real"]


def test_an_unknown_eval_workload_names_the_flag():
    assert parse_eval_workloads("short, prefix") == ["short", "prefix"]
    with pytest.raises(ValueError, match="--eval-workloads: \\['chat'\\] not among short"):
        parse_eval_workloads("short,chat")


def test_ratios_are_sim_over_real_of_every_reported_percentile():
    real = {"ttft": {"p50": 100.0, "p90": 200.0}, "tpot": {"p50": 10.0, "p90": 20.0}}
    sim = {"ttft": {"p50": 110.0, "p90": 150.0}, "tpot": {"p50": 10.0, "p90": 30.0}}
    assert ratios(real, sim) == {
        "ttft_p50": 1.1,
        "ttft_p90": 0.75,
        "tpot_p50": 1.0,
        "tpot_p90": 1.5,
    }
    assert len(METRICS) == 4


def test_fit_transfer_separates_the_fixed_cost_from_the_cost_per_byte():
    samples = [(n, 0.002 + n * 1e-9) for n in (1_000, 50_000, 200_000, 1_000_000)]
    fixed_s, byte_s = fit_transfer(samples)
    assert abs(fixed_s - 0.002) < 1e-9 and abs(byte_s - 1e-9) < 1e-15


def test_fit_transfer_puts_time_that_does_not_grow_with_bytes_in_the_fixed_cost():
    fixed_s, byte_s = fit_transfer([(1_000, 0.003), (100_000, 0.002), (10_000, 0.0025)])
    assert byte_s == 0.0 and 0.002 <= fixed_s <= 0.003


def test_fit_transfer_is_not_swayed_by_a_stalled_small_push():
    samples = [(n, 0.002 + n * 1e-9) for n in range(100_000, 1_100_000, 100_000)]
    fixed_s, byte_s = fit_transfer([*samples, (1_000, 0.5)])
    assert abs(byte_s - 1e-9) < 1e-12 and abs(fixed_s - 0.002) < 1e-4


def test_fit_transfer_needs_two_pushes():
    with pytest.raises(ValueError, match="1 pushes"):
        fit_transfer([(1_000, 0.003)])


def test_a_profile_of_every_served_step_keeps_their_mean_not_their_fastest(tmp_path):
    from pdserve.bench.engine.step_recorder import write_profile
    from pdserve.sim.profiles import parse_profile
    from pdserve.sim.timing import Chunk, StepWork

    def cost(work: StepWork) -> float:
        return 0.001 + 1e-5 * work.prefill_tokens + 1e-6 * work.context_tokens

    prefills = [StepWork.of([Chunk(start, n, decode=False)], 1) for start, n in _PREFILLS]
    decodes = [StepWork.of([Chunk(start, 1, decode=True)], 1) for start in (64, 300)]
    # Each decode step timed twice: once on a free core, once 2 ms longer while the worker's
    # Ray calls and token streams ran on its core.
    steps = [(work, cost(work)) for work in prefills]
    steps += [(work, cost(work) + extra) for work in decodes for extra in (0.0, 0.002)]
    fastest, every = tmp_path / "fastest.json", tmp_path / "every.json"
    write_profile(steps, str(fastest))
    write_profile(steps, str(every), every_sample=True)
    for work in decodes:
        from_fastest = parse_profile(str(fastest)).step_seconds(work)
        from_every = parse_profile(str(every)).step_seconds(work)
        assert abs(from_fastest - cost(work)) < 1e-4
        assert abs(from_every - (cost(work) + 0.001)) < 3e-4


_PREFILLS = ((0, 64), (0, 512), (256, 256))


def test_decode_pace_leaves_out_the_first_token_handoff_and_its_burst():
    from pdserve.bench.simulation.fidelity_bench import decode_pace
    from pdserve.workloads.metrics import RequestRecord

    # The first token comes late; the tokens decoded meanwhile arrive in one burst, then one
    # token every 10 ms.
    late = RequestRecord(0, "late", 8, 6, chunk_times=[0.1, 0.2, 0.21, 0.22])
    late.chunk_tokens = [1, 3, 1, 1]
    steady = RequestRecord(1, "steady", 8, 4, chunk_times=[0.0, 0.02, 0.04, 0.06])
    steady.chunk_tokens = [1, 1, 1, 1]
    single = RequestRecord(2, "single", 8, 1, chunk_times=[0.0], chunk_tokens=[1])
    pace = decode_pace([late, steady, single])
    assert pace == {"p50": 10.0, "p90": 20.0}  # late: 10 ms a token, steady: 20 ms
    assert late.tpot * 1e3 < 25  # what TPOT shows of `late`: 24 ms a token, the burst averaged
    assert decode_pace([single]) == {"p50": 0.0, "p90": 0.0}
