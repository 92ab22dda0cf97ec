"""`pdserve bench layout-ranking` (issue 49 point 6, the CPU half): how it ranks two layouts, the
simulated side on a profile whose ranking is known, and the command end to end on the tiny
model (real CPU workers, calibration, the simulated sweep, the real rates, the table). Runs the
command in a subprocess: it starts its own local Ray, and Ray allows one per process."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from pdserve.bench.simulation import layout_ranking, layout_ranking_sim
from pdserve.bench.simulation.layout_ranking import LAYOUTS, Ranking, agree, rank
from pdserve.models.builtin import builtin_model_dir

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_goodputs_within_the_tie_rank_no_layout_first_and_agree_with_either_order():
    assert rank({"1P:1D": 2.0, "colocated 2": 3.0}, tie=0.1) == Ranking("colocated 2", 1.5)
    assert rank({"1P:1D": 2.0, "colocated 2": 2.1}, tie=0.1).first is None
    assert rank({"1P:1D": 0.0, "colocated 2": 0.0}, tie=0.1) == Ranking(None, 1.0)
    assert rank({"1P:1D": 1.0, "colocated 2": 0.0}, tie=0.1).first == "1P:1D"
    first, other, tie = Ranking("1P:1D", 1.5), Ranking("colocated 2", 1.5), Ranking(None, 1.05)
    assert agree(first, first) and agree(first, tie) and agree(tie, other)
    assert not agree(first, other)


def test_the_simulation_puts_two_prefilling_workers_first_where_prefill_binds(tmp_path):
    """Prompts of 512-1536 tokens and 25-token answers on a profile where a prompt token costs
    far more than a decode: one prefill worker carries all the prompts that two colocated
    workers share, so colocated serves well over 1.5x the rate within the SLOs."""
    profile = tmp_path / "profile.json"
    profile.write_text(
        json.dumps(
            {
                "kind": "linear",
                "step_s": 0.002,
                "prefill_token_s": 4e-4,
                "decode_seq_s": 1e-4,
                "context_token_s": 1e-8,
            }
        )
    )
    args = argparse.Namespace(
        max_num_batched_tokens=512, slo_ttft_ms=3000.0, slo_tpot_ms=100.0, attainment=0.9, seed=0
    )
    model_dir = builtin_model_dir("tiny")
    model_config = json.loads((model_dir / "config.json").read_text())
    requests = layout_ranking._workload_requests("rag", model_config, 40, seed=0)
    assert all(512 <= r.prompt_len <= 1536 and r.output_len == 25 for r in requests)
    pushes = {"link_gbps": 10.0, "fixed_ms": 5.0}
    deployment = layout_ranking_sim.sim_deployment(model_dir, str(profile), pushes, args)
    goodput = {
        layout: layout_ranking_sim.sim_sweep(deployment, layout, lambda rate: requests, args)
        for layout in LAYOUTS
    }
    assert goodput["1P:1D"] > 0 and goodput["colocated 2"] > 1.5 * goodput["1P:1D"], goodput


def test_the_command_ranks_both_layouts_real_and_simulated_on_the_same_rates(tmp_path):
    out = tmp_path / "ranking.json"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    command = [
        sys.executable, "-m", "pdserve.cli", "bench", "layout-ranking", "--preset", "tiny",
        "--workloads", "code", "--duration", "0.2", "--min-requests", "6", "--rate-factors", "0.5,1",
        "--calibration-rates", "4", "--calibration-requests", "6", "--json", str(out),
    ]  # fmt: skip
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["profile"]["kind"] == "linear" and result["profile"]["device"] == "cpu"
    assert result["link_gbps"] > 0 and result["calibration_pushes"]["fixed_ms"] > 0
    (code,) = result["workloads"].values()
    calibration = code["calibration"]  # the profile refitted on steps serving `code` itself
    assert calibration["rate"] > 0 and calibration["profile"]["kind"] == "linear"
    assert calibration["profile"] != result["profile"]
    goodputs = code["sim_sweep"].values()
    measured = sorted({round(g * f, 4) for g in goodputs for f in (0.5, 1)})
    lower = code["rates"][: len(code["rates"]) - len(measured)]  # halvings where one missed
    assert code["rates"] == lower + measured and len(lower) <= 2
    rates = code["rates"]
    assert all(rates[k] == round(rates[k + 1] / 2, 4) for k in range(len(lower)))
    for system in ("real", "sim"):
        assert set(code[system]) == set(LAYOUTS)
        for curve in code[system].values():
            assert [p["rate"] for p in curve["points"]] == rates
            assert all(p["failed"] == 0 and 0 <= p["attainment"] <= 1 for p in curve["points"])
    real, sim = (Ranking(**code[f"rank_{system}"]) for system in ("real", "sim"))
    assert code["agree"] == agree(real, sim)
    assert "1P:1D vs 2 colocated" in done.stdout
    assert f"rankings agree on {int(code['agree'])} of 1 workloads" in done.stdout
