"""`pdserve bench sim-disagg --suite --at-rates`: families probed at the same rates on the same
requests, layout and engine setting."""

from __future__ import annotations

import pytest

from pdserve.bench.simulation import sim_disagg_bench
from pdserve.bench.simulation.disagg_suite.command import run_suite
from pdserve.bench.simulation.disagg_suite.paired import (
    family_layout,
    paired_attainment,
    paired_table,
)
from pdserve.bench.simulation.disagg_suite.screen import highest_held, paired_rows, row_key
from pdserve.bench.simulation.disagg_suite.suite import Setting, SuiteOptions
from tests.bench.cli_args import bench_args


def test_every_family_is_probed_at_every_rate_on_the_same_requests() -> None:
    setting = Setting(512, 64)
    options = SuiteOptions((setting,), requests_per_worker=30, steady_probes=False)
    families = ["colocated", "split", "auto"]
    probes = paired_attainment("70b", "code", "loose", families, "1:3", setting, [2.0, 400.0],
                               options)  # fmt: skip
    assert [(p.family, p.rate) for p in probes] == [(f, r) for r in (2.0, 400.0) for f in families]
    at = {(p.family, p.rate): p for p in probes}
    # The search's steady probe of each layout: here the whole sample (30 requests per
    # worker, shorter than a steady probe), for every family alike.
    assert {p.requests for p in probes} == {120}
    assert at["colocated", 2.0].remote_share == 0 and at["split", 2.0].remote_share == 1
    assert at["split", 2.0].layout == at["auto", 2.0].layout == "1P:3D (TP 4:4)"
    # Light load: every request within both SLOs. At 400 req/s the split's one prefill worker
    # queues past the TTFT SLO, where the others absorb the short probe's burst.
    assert all(at[f, 2.0].attainment == 1 for f in families)
    assert at["split", 400.0].attainment < 0.9 <= at["auto", 400.0].attainment
    # Point 5's TTFT target compares means: a remote prefill's handoff shows in the split's,
    # and its queue at 400 req/s far more.
    split_mean = {r: at["split", r].ttft_mean_ms for r in (2.0, 400.0)}
    assert at["colocated", 2.0].ttft_mean_ms < split_mean[2.0] < split_mean[400.0]
    table = paired_table(probes)
    assert table.endswith(
        "highest attainment at: colocated 2 of 2 rates, split 1 of 2 rates, auto 2 of 2 rates"
    )  # ties count for each


def test_equal_rate_probes_become_screen_rows_judged_with_the_rest() -> None:
    """`--at-rates --screen-rows`: each probe a row of the screen's JSONL, on its family's
    layout (colocated its own), so the confirmed table's highest held figure counts it."""
    setting = Setting(512, 64)
    options = SuiteOptions((setting,), requests_per_worker=30, steady_probes=False)
    families = ["colocated", "auto"]
    probes = paired_attainment("70b", "code", "loose", families, "1:3", setting, [2.0, 400.0],
                               options)  # fmt: skip
    rows = paired_rows(probes, "70b", "code", "loose", "1:3", setting, 30)
    assert [(r["family"], r["split"], r["rate"]) for r in rows] == [
        ("colocated", "colocated", 2.0), ("auto", "1:3", 2.0),
        ("colocated", "colocated", 400.0), ("auto", "1:3", 400.0),
    ]  # fmt: skip
    assert {r["source"] for r in rows if r["family"] == "auto"} == {"equal rates with colocated"}
    for row, probe in zip(rows, probes, strict=True):
        assert (row["holds"], row["complete"]) == (probe.attainment >= 0.9, True)
        assert (row["chunk"], row["batch"], row["requests_per_worker"]) == (512, 64, 30)
    assert len({row_key(r) for r in rows}) == 4
    auto = [r for r in rows if r["family"] == "auto"]
    assert highest_held(auto)["rate"] == 400.0  # auto holds at both (see the test above)


def test_at_rates_takes_one_cell_split_and_setting(capsys) -> None:
    args = bench_args(sim_disagg_bench, models="70b", suite_workloads="code",
                      slos="loose", splits="1:3", chunks="512,2048", batch_limits="64",
                      at_rates="2")  # fmt: skip
    assert run_suite(args) == 2
    assert "--chunks x --batch-limits" in capsys.readouterr().out


def test_only_auto_has_the_hybrid_layout() -> None:
    assert family_layout("70b", "auto", "hybrid").name == "hybrid 4 (TP 4)"
    with pytest.raises(ValueError, match="threshold has no layout 'hybrid'"):
        family_layout("70b", "threshold", "hybrid")


def test_a_push_fixed_cost_reaches_the_split_and_not_colocated() -> None:
    """`--push-fixed-ms`: every push of the simulated cluster also pays it. The first token is
    streamed before the push, so it lands in the split's TPOT (the second token waits for the
    commit), and colocated, which pushes nothing, does not move."""
    setting = Setting(512, 64)
    at = {}
    for push_ms in (0.0, 40.0):
        options = SuiteOptions((setting,), requests_per_worker=30, steady_probes=False,
                               push_fixed_ms=push_ms)  # fmt: skip
        for p in paired_attainment("70b", "code", "loose", ["colocated", "split"], "1:3",
                                   setting, [2.0], options):  # fmt: skip
            at[p.family, push_ms] = p
    assert at["colocated", 40.0].tpot_p90_ms == at["colocated", 0.0].tpot_p90_ms
    assert at["split", 40.0].tpot_p90_ms > at["split", 0.0].tpot_p90_ms + 0.5
    assert at["split", 40.0].ttft_mean_ms == pytest.approx(at["split", 0.0].ttft_mean_ms, rel=0.05)


def test_push_fixed_ms_is_refused_where_figures_were_measured_without_it(capsys) -> None:
    args = bench_args(sim_disagg_bench, models="70b", suite_workloads="code", slos="loose",
                      screen="docs/benchmarks/sim-disagg-suite", push_fixed_ms=2.0)  # fmt: skip
    assert run_suite(args) == 2
    assert "--push-fixed-ms: not with --screen" in capsys.readouterr().out
