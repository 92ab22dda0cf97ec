"""`pdserve bench sim-disagg` end to end on two sim workers: the report's structure and its
numbers' consistency (attainment, goodput, where prompts were prefilled), not the targets."""

from __future__ import annotations

import argparse
import json

import pytest

from pdserve.bench.simulation import sim_disagg_bench
from pdserve.workloads.metrics import goodput_rate
from tests.bench.cli_args import bench_args


def _args(**overrides) -> argparse.Namespace:
    return bench_args(sim_disagg_bench, **overrides)


def test_two_layouts_two_rates_report_consistent_figures(
    ray_cluster, sim_model_dir, tmp_path, capsys
):
    out = tmp_path / "result.json"
    args = _args(
        model=sim_model_dir,
        workers=2,
        layouts="colocated,1:1",
        workloads="chat-rag",
        rates="16,40",
        duration=0.01,
        min_requests=8,
        rag_fraction=0.5,
        chat_max_output_len=12,
        rag_output_len=4,
        warmup_requests=2,
        block_size=4,
        num_kv_blocks=8192,
        sim_time_scale=3,
        max_excess=1.0,
        max_overrun_fraction=1.0,
        json=out,
        plot=tmp_path / "plots",
    )
    assert sim_disagg_bench.run(args) == 0
    document = json.loads(out.read_text())
    assert list(document) == ["chat-rag"]
    colocated, split = document["chat-rag"]
    assert (colocated["layout"], colocated["prefill_workers"], colocated["decode_workers"]) == (
        "colocated",
        0,
        2,
    )
    assert (split["layout"], split["disaggregate"]) == ("1:1", "always")
    for layout in (colocated, split):
        assert [p["rate"] for p in layout["points"]] == [16.0, 40.0]
        for point in layout["points"]:
            assert point["completed"] + point["failed"] == 8
            assert 0.0 <= point["attainment"] <= 1.0
            assert point["ttft_p50_ms"] <= point["ttft_p90_ms"]
            assert point["tpot_p50_ms"] <= point["tpot_p90_ms"]
        attainment = {p["rate"]: p["attainment"] for p in layout["points"]}
        assert layout["goodput"] == pytest.approx(goodput_rate(attainment, 0.9))
        assert len(layout["saturation"]) == 2
    # Colocated prefills every prompt on its decode worker; a fixed split never does.
    assert all(p["local_prefills"] == 1.0 for p in colocated["points"])
    assert all(p["local_prefills"] == 0.0 for p in split["points"])
    printed = capsys.readouterr().out
    assert "best split 1:1" in printed and "colocated" in printed
    assert (tmp_path / "plots" / "chat-rag-attainment.png").stat().st_size > 0


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("colocated", (0, 8, "never")),
        ("3:5", (3, 5, "always")),
        ("auto 2:6", (2, 6, "auto")),
    ],
)
def test_layout_names(name, expected):
    assert sim_disagg_bench.parse_layout(name) == expected


@pytest.mark.parametrize("name", ["0:8", "4:5", "fast 4:4", "4-4"])
def test_bad_layout_names_are_refused(name):
    with pytest.raises(ValueError, match="layout"):
        sim_disagg_bench.parse_layout(name)


def test_a_bad_layout_is_one_line_on_stderr_and_exit_status_2(capsys):
    assert sim_disagg_bench.run(_args(layouts="colocated,5:5")) == 2
    err = capsys.readouterr().err
    assert err.startswith("pdserve bench: error: layout '5:5'") and err.count("\n") == 1
