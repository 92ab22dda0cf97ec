"""`sim-disagg --suite --screen`: documented figures judged on their steady probes, from the
highest down per cell and family, and the confirmed table built from what held."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from pdserve.bench.simulation import sim_disagg_bench
from pdserve.bench.simulation.disagg_suite.command import _write_json, run_suite
from pdserve.bench.simulation.disagg_suite.confirmed import SCREEN, confirmed_markdown
from pdserve.bench.simulation.disagg_suite.curves import CURVE_FRACTIONS
from pdserve.bench.simulation.disagg_suite.paired import PairedProbe
from pdserve.bench.simulation.disagg_suite.plots import summary_markdown
from pdserve.bench.simulation.disagg_suite.screen import (
    Figure,
    attainment_text,
    documented_figures,
    read_rows,
    screen,
    screen_row,
    with_looser_slos,
)
from pdserve.bench.simulation.disagg_suite.suite import Cell, FamilyBest, Setting
from tests.bench.cli_args import bench_args
from tests.bench.simulation.screen_helpers import figure_at, probe_holding_up_to


def _family(family: str, **searched: float) -> FamilyBest:
    best = FamilyBest(family)
    for name, rate in searched.items():
        layout, chunk = name.rsplit("_", 1)
        entry = f"{layout.replace('_', ':')} chunk {chunk} batch 256"
        best.searched[entry] = rate
        if rate > best.goodput:
            best.goodput, best.split, best.setting = rate, layout, Setting(int(chunk), 256)
    return best


def _suite_file(path: Path) -> None:
    cell = Cell("70b", "code", "loose", ceiling=240.0)
    cell.families["colocated"] = _family("colocated", **{"colocated 4 (TP 4)_512": 190.0})
    cell.families["auto"] = _family(
        "auto", **{"1P_3D (TP 4_4)_2048": 230.0, "hybrid 4 (TP 4)_512": 185.0, "3P_1D_512": 0.0}
    )
    _write_json(path, [cell])


def test_figures_of_every_suite_file_once_each(tmp_path: Path) -> None:
    _suite_file(tmp_path / "a.json")
    _suite_file(tmp_path / "b.json")  # the same figures again: kept once, from a.json
    (tmp_path / "other.json").write_text(json.dumps({"not": "a suite file"}))
    figures = documented_figures(sorted(tmp_path.glob("*.json")))
    got = sorted((f.family, f.split, f.chunk, f.rate, Path(f.source).name) for f in figures)
    assert got == [
        ("auto", "1:3", 2048, 230.0, "a.json"),
        ("auto", "hybrid", 512, 185.0, "a.json"),  # a goodput of 0 is no figure
        ("colocated", "colocated", 512, 190.0, "a.json"),
    ]


def test_each_family_from_its_highest_figure_down_until_one_holds() -> None:
    figures = [figure_at("auto", r) for r in (150, 230, 200, 260, 170)]
    figures += [figure_at("colocated", r, "colocated") for r in (120, 180)]
    calls: list[Figure] = []
    rows = screen(figures, {}, depth=8, probe=probe_holding_up_to(175, calls),
                  ceiling=lambda model, workload: 240.0)  # fmt: skip
    # 260 lies above the compute ceiling: a burst by arithmetic, never probed.
    assert [(f.family, f.rate) for f in calls] == [
        ("auto", 230), ("auto", 200), ("auto", 170), ("colocated", 180), ("colocated", 120)
    ]  # fmt: skip
    assert [(r["rate"], r["holds"], r["attainment"]) for r in rows] == [
        (230, False, 0.4), (200, False, 0.4), (170, True, 0.95),
        (180, False, 0.4), (120, True, 0.95),
    ]  # fmt: skip


def test_a_screen_gives_up_after_depth_figures_and_reuses_earlier_rows() -> None:
    figures = [figure_at("auto", r) for r in (230, 200, 170, 150)]
    first: list[Figure] = []
    rows = screen(figures, {}, depth=2, probe=probe_holding_up_to(100, first),
                  ceiling=lambda model, workload: None)  # fmt: skip
    assert [f.rate for f in first] == [230, 200] and not any(r["holds"] for r in rows)
    done = {figure.key: row for figure, row in zip(first, rows, strict=True)}
    again: list[Figure] = []
    rows = screen(figures, done, depth=3, probe=probe_holding_up_to(180, again),
                  ceiling=lambda model, workload: None)  # fmt: skip
    assert [f.rate for f in again] == [170]  # only the figure the first screen lacked
    assert [r["holds"] for r in rows] == [False, False, True]


def test_the_confirmed_table_judges_the_targets_on_held_figures_only(tmp_path: Path) -> None:
    calls: list[Figure] = []
    figures = [figure_at("colocated", 180, "colocated"), figure_at("colocated", 120, "colocated"),
               figure_at("split", 100, "3:1"), figure_at("auto", 230), figure_at("auto", 170),
               figure_at("threshold", 200)]  # fmt: skip
    probe = probe_holding_up_to(175, calls)
    rows = screen(figures, {}, depth=2, probe=probe, ceiling=lambda model, workload: None)
    table = confirmed_markdown(rows).splitlines()
    assert len(table) == 3
    cells = [c.strip() for c in table[2].strip("|").split("|")]
    assert cells[:8] == [
        "70b", "code", "loose", "120 (chunk 512)", "100 (3:1 layout, chunk 512)",
        "170 (1:3 layout, chunk 512)", "none held (1 probed; 200: 0.40)", "-",
    ]  # fmt: skip
    # auto 170 against colocated 120: threshold's 200 failed its probe, so is not judged.
    assert cells[8:] == ["1.42", "1.42", "none", "3 / 6"]
    # A screen on another sample (agentic, mix and phases depend on its block) is its own row.
    [other] = screen([replace(figures[0], requests_per_worker=500)], {}, depth=1, probe=probe,
                     ceiling=lambda model, workload: None)  # fmt: skip
    table = confirmed_markdown([*rows, other]).splitlines()
    assert table[3].startswith("| 70b | code (500 per worker) | loose | none held (1 probed;")
    # A cell where no search found a rate for any family: a row of zeros, in the suite's order.
    table = confirmed_markdown(rows, [("70b", "chat", "tight-ttft")]).splitlines()
    assert table[2] == "| 70b | chat | tight-ttft | 0 | 0 | 0 | 0 | 0 | - | - | none | 0 / 0 |"
    # The summary carries it when the coverage folder holds a screen.
    (tmp_path / "coverage").mkdir()
    with (tmp_path / "coverage" / SCREEN).open("w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    assert confirmed_markdown(list(read_rows(tmp_path / "coverage" / SCREEN).values())) in (
        summary_markdown(tmp_path)
    )


def test_screen_command_probes_documented_figures_until_one_holds(tmp_path: Path, capsys) -> None:
    cell = Cell("70b", "code", "loose", ceiling=240.0)
    cell.families["colocated"] = _family("colocated", **{"colocated 4 (TP 4)_512": 2.0})
    cell.families["colocated"].searched = {
        "colocated 4 (TP 4) chunk 512 batch 16": 2.0,
        "colocated 4 (TP 4) chunk 2048 batch 16": 200.0,
    }
    _write_json(tmp_path / "suite.json", [cell])
    out = tmp_path / "screen.jsonl"
    args = bench_args(sim_disagg_bench, models="70b", suite_workloads="code", slos="loose",
                      families="colocated", screen=str(tmp_path / "suite.json"),
                      json=str(out))  # fmt: skip
    assert run_suite(args) == 0
    burst, held = read_rows(out).values()
    # The steady probe: 8 x max_num_seqs requests per worker, on one replica of two of the four
    # workers (as the search probes it), each stopped once its verdict is certain. At 200 req/s
    # a batch of 16 queues past the TTFT SLO within the first requests.
    assert {burst["requests"], held["requests"]} == {8 * 16 * 2}
    assert (burst["rate"], burst["holds"], burst["complete"]) == (200.0, False, False)
    assert burst["missed"] > 0.1 * burst["requests"]
    upper = 1 - burst["missed"] / burst["requests"]
    assert float(attainment_text(burst)[2:]) - 0.01 <= upper < float(attainment_text(burst)[2:])
    assert (held["layout"], held["rate"], held["batch"]) == ("colocated 4 (TP 4)", 2.0, 16)
    assert held["holds"] and held["attainment"] >= 0.9
    printed = capsys.readouterr().out
    assert f"at 200.00 req/s: {attainment_text(burst)} within SLO, fails" in printed
    assert attainment_text(burst).startswith("< ")
    assert "2 figures judged, 1 hold" in printed
    assert run_suite(args) == 0  # resumed: nothing left to probe
    assert "2 judged in" in capsys.readouterr().out and len(out.read_text().splitlines()) == 2


def test_a_figure_is_also_a_candidate_under_every_looser_slo_pair() -> None:
    tpot18 = replace(figure_at("split", 7.8, "3:1"), slo="tighter-tpot")
    loose = figure_at("split", 9.0, "3:1")
    figures = with_looser_slos([tpot18, loose])
    # TPOT <= 18 ms at TTFT <= 1 s is within 20 ms (at TTFT <= 1 s and <= 2 s), the loose pair
    # and 18 ms at the looser TTFTs; not within TTFT <= 200 ms or <= 950 ms. The loose pair's
    # TPOT <= 50 ms is within none of the others.
    assert sorted((f.slo, f.rate, f.source) for f in figures) == [
        ("loose", 7.8, "x.json (tighter-tpot)"), ("loose", 9.0, "x.json"),
        ("tight-tpot", 7.8, "x.json (tighter-tpot)"),
        ("tight-tpot-2s", 7.8, "x.json (tighter-tpot)"), ("tighter-tpot", 7.8, "x.json"),
        ("tighter-tpot-1.2s", 7.8, "x.json (tighter-tpot)"),
        ("tighter-tpot-1.5s", 7.8, "x.json (tighter-tpot)"),
        ("tighter-tpot-2s", 7.8, "x.json (tighter-tpot)"),
    ]  # fmt: skip
    # A documented figure is kept as documented, not as another pair's copy.
    assert with_looser_slos([loose, replace(loose, slo="tight-tpot")])[0].source == "x.json"
    kept = with_looser_slos([loose, replace(loose, slo="tight-tpot")])
    assert sorted((f.slo, f.source) for f in kept) == [
        ("loose", "x.json"), ("tight-tpot", "x.json"), ("tight-tpot-2s", "x.json (tight-tpot)"),
    ]  # fmt: skip


def test_refine_bisects_the_gap_above_the_figure_that_held_on_each_failed_setting() -> None:
    # Bursts at 230 and 200 on two layouts, the next figure 150 on a third: the family holds
    # to 175 (this probe does not tell layouts apart).
    figures = [figure_at("auto", 230, "2:2"), figure_at("auto", 200, "3:1"), figure_at("auto", 150)]
    calls: list[Figure] = []
    rows = screen(figures, {}, depth=8, probe=probe_holding_up_to(175, calls),
                  ceiling=lambda model, workload: None, refine=0.02)  # fmt: skip
    bisected = calls[3:]
    assert {f.source for f in bisected} == {"bisected below x.json"}
    # The highest failed layout first, then the next one from the best rate held so far.
    assert [f.split for f in bisected] == sorted(f.split for f in bisected)
    assert {f.split for f in bisected} == {"2:2", "3:1"}
    assert all(150 < f.rate < 230 for f in bisected)
    best = max(r["rate"] for r in rows if r["holds"])
    assert 175 / 1.02 <= best <= 175
    # Without refine the family stays at the figure that held.
    plain = screen(figures, {}, depth=8, probe=probe_holding_up_to(175, []),
                   ceiling=lambda model, workload: None)  # fmt: skip
    assert [r["rate"] for r in plain] == [230, 200, 150]


def test_plot_confirmed_draws_each_family_at_its_highest_heldfigure_at(tmp_path: Path) -> None:
    """`--plot DIR --plot-confirmed`: no search; the family's curve is offered load on the
    layout and setting of its highest held figure in DIR/coverage/screen.jsonl."""
    held = Figure("70b", "code", "loose", "colocated", "colocated", 512, 16, 2.0, "x.json")
    lower = replace(held, rate=1.0)  # held too, but lower: not the confirmed figure
    burst = replace(held, chunk=2048, rate=200.0)
    verdicts = {2.0: (True, 0.95), 1.0: (True, 1.0), 200.0: (False, 0.05)}
    (tmp_path / "coverage").mkdir()
    with (tmp_path / "coverage" / SCREEN).open("w") as f:
        for figure in (held, lower, burst):
            holds, attainment = verdicts[figure.rate]
            probe = PairedProbe("colocated", "colocated 4 (TP 4)", figure.rate, 100,
                                round(attainment * 100), 500.0, 800.0, 30.0, 0.0)  # fmt: skip
            f.write(json.dumps(screen_row(figure, probe)) + "\n")
    args = bench_args(sim_disagg_bench, models="70b", suite_workloads="code", slos="loose,tight-tpot",
                      families="colocated", plot=str(tmp_path), plot_confirmed=True)  # fmt: skip
    assert run_suite(args) == 0
    [curve] = json.loads((tmp_path / "70b-code.json").read_text())["loose"].values()
    assert curve["goodput"] == 2.0
    assert curve["label"] == "colocated 4 (TP 4), chunk 512, batch 16"
    top = 2.0  # the cell's highest confirmed figure: the curve's rates are its fractions
    assert [rate for rate, _ in curve["points"]] == sorted(
        {round(f * top, 3) for f in CURVE_FRACTIONS} | {2.0}
    )
    assert dict(curve["points"])[2.0] >= 0.9  # the held figure, run to its end, holds
    assert (tmp_path / "70b-code.png").stat().st_size > 0
    assert "| 70b | code | loose | 2.0 |" in (tmp_path / "summary.md").read_text()
