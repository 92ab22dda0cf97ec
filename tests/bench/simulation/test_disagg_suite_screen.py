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
    highest_held,
    read_rows,
    row_key,
    screen,
    screen_row,
    sweep_settings,
    with_looser_slos,
)
from pdserve.bench.simulation.disagg_suite.suite import Cell, FamilyBest, Setting
from tests.bench.cli_args import bench_args


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


def _probe_holding_up_to(limit: float, calls: list[Figure]):
    def probe(figure: Figure) -> PairedProbe:
        calls.append(figure)
        good = 95 if figure.rate <= limit else 40
        return PairedProbe(figure.family, f"{figure.split} layout", figure.rate, 100, good,
                           300.0, 500.0, 20.0, 0.5)  # fmt: skip

    return probe


def _figure(family: str, rate: float, split: str = "1:3") -> Figure:
    return Figure("70b", "code", "loose", family, split, 512, 256, rate, "x.json")


def test_each_family_from_its_highest_figure_down_until_one_holds() -> None:
    figures = [_figure("auto", r) for r in (150, 230, 200, 260, 170)]
    figures += [_figure("colocated", r, "colocated") for r in (120, 180)]
    calls: list[Figure] = []
    rows = screen(figures, {}, depth=8, probe=_probe_holding_up_to(175, calls),
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
    figures = [_figure("auto", r) for r in (230, 200, 170, 150)]
    first: list[Figure] = []
    rows = screen(figures, {}, depth=2, probe=_probe_holding_up_to(100, first),
                  ceiling=lambda model, workload: None)  # fmt: skip
    assert [f.rate for f in first] == [230, 200] and not any(r["holds"] for r in rows)
    done = {figure.key: row for figure, row in zip(first, rows, strict=True)}
    again: list[Figure] = []
    rows = screen(figures, done, depth=3, probe=_probe_holding_up_to(180, again),
                  ceiling=lambda model, workload: None)  # fmt: skip
    assert [f.rate for f in again] == [170]  # only the figure the first screen lacked
    assert [r["holds"] for r in rows] == [False, False, True]


def test_the_confirmed_table_judges_the_targets_on_held_figures_only(tmp_path: Path) -> None:
    calls: list[Figure] = []
    figures = [_figure("colocated", 180, "colocated"), _figure("colocated", 120, "colocated"),
               _figure("split", 100, "3:1"), _figure("auto", 230), _figure("auto", 170),
               _figure("threshold", 200)]  # fmt: skip
    probe = _probe_holding_up_to(175, calls)
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
    tpot18 = replace(_figure("split", 7.8, "3:1"), slo="tighter-tpot")
    loose = _figure("split", 9.0, "3:1")
    figures = with_looser_slos([tpot18, loose])
    # TPOT <= 18 ms is within 20 ms and the loose pair; not within TTFT <= 200 ms.
    assert sorted((f.slo, f.rate, f.source) for f in figures) == [
        ("loose", 7.8, "x.json (tighter-tpot)"), ("loose", 9.0, "x.json"),
        ("tight-tpot", 7.8, "x.json (tighter-tpot)"), ("tighter-tpot", 7.8, "x.json"),
    ]  # fmt: skip
    # A documented figure is kept as documented, not as another pair's copy.
    assert with_looser_slos([loose, replace(loose, slo="tight-tpot")])[0].source == "x.json"
    assert len(with_looser_slos([loose, replace(loose, slo="tight-tpot")])) == 2


def test_refine_bisects_the_gap_above_the_figure_that_held_on_each_failed_setting() -> None:
    # Bursts at 230 and 200 on two layouts, the next figure 150 on a third: the family holds
    # to 175 (this probe does not tell layouts apart).
    figures = [_figure("auto", 230, "2:2"), _figure("auto", 200, "3:1"), _figure("auto", 150)]
    calls: list[Figure] = []
    rows = screen(figures, {}, depth=8, probe=_probe_holding_up_to(175, calls),
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
    plain = screen(figures, {}, depth=8, probe=_probe_holding_up_to(175, []),
                   ceiling=lambda model, workload: None)  # fmt: skip
    assert [r["rate"] for r in plain] == [230, 200, 150]


def test_plot_confirmed_draws_each_family_at_its_highest_held_figure(tmp_path: Path) -> None:
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


def test_the_setting_sweep_raises_the_best_rate_held_on_each_other_setting() -> None:
    """Point 0 where a search tried one engine setting: the confirmed layout at every other
    setting, each from the best rate held so far up by the step while it holds."""
    limits = {(2048, 256): 103.0, (512, 256): 120.0, (1024, 256): 110.0, (256, 128): 50.0}
    calls: list[Figure] = []

    def probe(figure: Figure) -> PairedProbe:
        calls.append(figure)
        holds = figure.rate <= limits.get((figure.chunk, figure.batch), 0.0)
        return PairedProbe(figure.family, "3P:1D", figure.rate, 100, 95 if holds else 40,
                           300.0, 500.0, 20.0, 1.0)  # fmt: skip

    held = replace(_figure("split", 100.0, "3:1"), chunk=2048)
    rows = [screen_row(held, _probe_holding_up_to(100, [])(held))]
    settings = [Setting(2048, 256), Setting(512, 256), Setting(1024, 256), Setting(256, 128)]
    judged = sweep_settings(rows, settings, 0.05, {}, probe=probe,
                            ceiling=lambda model, workload: None)  # fmt: skip
    # The held figure's own setting first, one step up (fails); then 512 climbs past the held
    # 100 to 115.76 and fails at 121.55; 1024 and 256x128 must beat 115.76 and fail their first
    # probe. No chunk between is tried: 512 broke TTFT at 121.55 (p90 500 of 1000 ms, TPOT 20
    # of 50), and so did 1024, the next larger one, at that rate.
    assert [(f.chunk, f.batch, round(f.rate, 2)) for f in calls] == [
        (2048, 256, 105.0), (512, 256, 105.0), (512, 256, 110.25), (512, 256, 115.76), (512, 256, 121.55),
        (1024, 256, 121.55), (256, 128, 121.55),
    ]  # fmt: skip
    best = max((r for r in judged if r["holds"]), key=lambda r: r["rate"])
    assert (best["chunk"], best["split"], round(best["rate"], 2)) == (512, "3:1", 115.76)
    assert best["source"] == "setting sweep of 3:1 chunk 2048 batch 256"
    # Run again on its rows, it goes on from 115.76 at 512: only the held figure's own 2048,
    # offered 105 before, is offered 121.55; under a compute ceiling nothing above it.
    done = {row_key(r): r for r in judged}
    again = sweep_settings(rows, settings, 0.05, done, probe=probe,
                           ceiling=lambda model, workload: None)  # fmt: skip
    assert [(r["chunk"], round(r["rate"], 2), r["holds"]) for r in again] == [
        (512, 121.55, False), (2048, 121.55, False), (1024, 121.55, False), (256, 121.55, False),
    ]  # fmt: skip
    assert len(calls) == 8
    done.update((row_key(r), r) for r in again)
    assert sweep_settings(rows, settings, 0.05, done, probe=probe,
                          ceiling=lambda model, workload: None) == again  # fmt: skip
    assert len(calls) == 8
    capped = sweep_settings(rows, settings, 0.05, {}, probe=probe,
                            ceiling=lambda model, workload: 112.0)  # fmt: skip
    assert [round(r["rate"], 2) for r in capped] == [105.0, 105.0, 110.25]


def test_auto_also_climbs_on_the_layout_and_setting_where_each_other_family_held_most() -> None:
    """`auto` runs on any layout: the sweep offers it each layout and setting where another
    family of the cell held its highest figure (a P:D split as it is, colocated's as hybrid
    workers), from `auto`'s best up."""
    limits = {("hybrid", 2048): 100.0, ("hybrid", 1024): 100.0, ("1:7", 512): 130.0,
              ("3:5", 2048): 90.0}  # fmt: skip
    calls: list[Figure] = []

    def probe(figure: Figure) -> PairedProbe:
        calls.append(figure)
        holds = figure.rate <= limits.get((figure.split, figure.chunk), 0.0)
        return PairedProbe(figure.family, figure.split, figure.rate, 100, 95 if holds else 40,
                           300.0, 500.0, 20.0, 1.0)  # fmt: skip

    def held(family: str, split: str, chunk: int, rate: float, **other) -> dict:
        figure = replace(_figure(family, rate, split), chunk=chunk, **other)
        return screen_row(figure, _probe_holding_up_to(rate, [])(figure))

    auto = held("auto", "hybrid", 2048, 100.0)
    peers = [
        auto,
        held("conditional", "1:7", 512, 120.0, batch=128),
        held("conditional", "1:7", 2048, 80.0),  # not its highest
        held("threshold", "3:5", 2048, 90.0),
        held("split", "3:5", 2048, 85.0),  # the same layout and setting: offered once
        held("colocated", "colocated", 1024, 110.0),  # `auto` there: hybrid workers
        held("split", "2:6", 2048, 200.0, workload="chat"),  # another cell
    ]
    done = {row_key(row): row for row in peers}
    judged = sweep_settings([auto], [], 0.05, done, probe=probe,
                            ceiling=lambda model, workload: None)  # fmt: skip
    # Its own layout one step up (fails), then conditional's 1:7 at chunk 512 batch 128 from
    # auto's 100 up to 127.63, then hybrid workers at colocated's chunk 1024 and threshold's
    # 3:5, each offered 134.01 (fail); last the chunk on the leader's layout and batch limit:
    # no other was tried on 1:7, so twice 512.
    assert [(f.split, f.chunk, f.batch, round(f.rate, 2)) for f in calls] == [
        ("hybrid", 2048, 256, 105.0),
        *(("1:7", 512, 128, r) for r in (105.0, 110.25, 115.76, 121.55, 127.63, 134.01)),
        ("hybrid", 1024, 256, 134.01),
        ("3:5", 2048, 256, 134.01),
        ("1:7", 1024, 128, 134.01),
    ]  # fmt: skip
    assert {f.family for f in calls} == {"auto"}
    best = max((r for r in judged if r["holds"]), key=lambda r: r["rate"])
    assert best["source"] == "auto on conditional's 1:7 layout"
    # A rule's rate between two of `auto`'s rungs is offered to `auto` at that rate on its
    # layout and setting (equal rates), here held: 123 against the ladder's last 121.55.
    limits["1:7", 512] = 123.0
    calls.clear()
    rule = held("conditional", "1:7", 512, 123.0, batch=128)
    rule_at = {key: row for key, row in done.items() if row is not peers[1]}
    rule_at[row_key(rule)] = rule
    judged = sweep_settings([auto], [], 0.05, rule_at, probe=probe,
                            ceiling=lambda model, workload: None)  # fmt: skip
    # Then the refinement from 123 on 1:7: one step up at chunk 512 (fails on TTFT) and 1024.
    assert [(f.split, f.chunk, round(f.rate, 2)) for f in calls][-6:] == [
        ("1:7", 512, 127.63), ("1:7", 512, 123.0), ("hybrid", 1024, 129.15),
        ("3:5", 2048, 129.15), ("1:7", 512, 129.15), ("1:7", 1024, 129.15),
    ]  # fmt: skip
    best = max((r for r in judged if r["holds"]), key=lambda r: r["rate"])
    assert (best["split"], best["rate"]) == ("1:7", 123.0)
    # On `auto`'s own layout and setting too (already climbed, so offered the rate alone).
    limits["2:6", 1024] = 104.0
    calls.clear()
    own = held("auto", "2:6", 1024, 100.0)
    rule = held("conditional", "2:6", 1024, 103.0)
    judged = sweep_settings([own], [], 0.05, {row_key(r): r for r in (own, rule)}, probe=probe,
                            ceiling=lambda model, workload: None)  # fmt: skip
    # Then the refinement: one step above 103 at 1024, and past the edge of the one chunk
    # tried, at twice it.
    assert [(f.split, f.chunk, round(f.rate, 2)) for f in calls] == [
        ("2:6", 1024, 105.0), ("2:6", 1024, 103.0), ("2:6", 1024, 108.15), ("2:6", 2048, 108.15),
    ]  # fmt: skip
    assert highest_held(judged)["rate"] == 103.0
    # Colocated's figure above `auto`'s: hybrid workers at its setting, offered its rate too
    # (70B agentic loose: colocated 129.39 at chunk 512, `auto` 111 on 2P:2D).
    limits["hybrid", 512] = 112.0
    calls.clear()
    colocated = held("colocated", "colocated", 512, 111.0)
    judged = sweep_settings([own], [], 0.05, {row_key(r): r for r in (own, colocated)},
                            probe=probe, ceiling=lambda model, workload: None)  # fmt: skip
    assert [(f.split, f.chunk, round(f.rate, 2)) for f in calls] == [
        ("2:6", 1024, 105.0), ("hybrid", 512, 105.0), ("hybrid", 512, 110.25),
        ("hybrid", 512, 115.76), ("hybrid", 512, 111.0), ("hybrid", 512, 116.55),
        ("hybrid", 1024, 116.55),
    ]  # fmt: skip
    assert (highest_held(judged)["split"], highest_held(judged)["rate"]) == ("hybrid", 111.0)
    # Another family does not borrow.
    calls.clear()
    sweep_settings([peers[3]], [], 0.05, done, probe=probe,
                   ceiling=lambda model, workload: None)  # fmt: skip
    assert [(f.family, f.split, f.chunk) for f in calls] == [
        ("threshold", "3:5", 2048), ("threshold", "3:5", 4096),
    ]  # fmt: skip


def test_the_sweep_refines_the_chunk_toward_the_slo_its_leader_breaks() -> None:
    """Between the grid's chunks: below the best chunk the prefill queue breaks TTFT, above it
    decode stalls break TPOT (8B rag at TPOT <= 20 ms: 576 and 640 held most, 512 and 1024
    less), so the sweep bisects the chunk the way the leader's failure points; past the grid's
    edge it doubles (70B rag: the best at the largest chunk, 2048)."""
    calls: list[Figure] = []

    def probe_with(limit):
        def probe(figure: Figure) -> PairedProbe:
            calls.append(figure)
            top, queue_bound = limit(figure.chunk)
            ttft, tpot = (1500.0, 10.0) if queue_bound else (500.0, 30.0)
            return PairedProbe(figure.family, figure.split, figure.rate, 100,
                               95 if figure.rate <= top else 40, 300.0, ttft, tpot, 1.0)  # fmt: skip

        return probe

    knee = probe_with(lambda chunk: (100 - abs(chunk - 600) / 5, chunk < 600))
    held = replace(_figure("auto", 90.0, "3:5"), slo="tight-tpot")
    rows = [screen_row(held, _probe_holding_up_to(90, [])(held))]
    settings = [Setting(512, 256), Setting(1024, 256)]
    judged = sweep_settings(rows, settings, 0.02, {}, probe=knee,
                            ceiling=lambda model, workload: None)  # fmt: skip
    refined = [(f.chunk, round(f.rate, 2)) for f in calls if f.source.startswith("chunk")]
    # 512 breaks TTFT one step above its 90 and 1024 TPOT: halfway, 768 breaks TPOT (overshot);
    # halfway back, 640 leads and breaks TPOT, and 512 TTFT at that rate; halfway down, 576
    # leads and breaks TTFT, 640 TPOT, and the next half (608 -> 640 on the 64-token grain)
    # was tried: the sweep stops at 576.
    assert sorted({chunk for chunk, _ in refined}) == [512, 576, 640, 768]
    best = highest_held(judged)
    assert (best["chunk"], best["source"]) == (576, "chunk refined from 512")
    assert 95.2 >= best["rate"] > 95.2 / 1.02  # 576's limit, to the step
    assert all(f.batch == 256 and f.split == "3:5" for f in calls)
    # Swept again over its rows: the grid's chunks are offered the new best's next rung (as
    # any second sweep does), and the refinement's every step is read from the rows.
    calls.clear()
    again = sweep_settings(rows, settings, 0.02, {row_key(r): r for r in judged}, probe=knee,
                           ceiling=lambda model, workload: None)  # fmt: skip
    rung = round(best["rate"] * 1.02, 2)
    assert [(f.chunk, round(f.rate, 2)) for f in calls] == [(512, rung), (1024, rung)]
    assert not any(row["holds"] for row in again)

    calls.clear()
    edge = probe_with(lambda chunk: (min(chunk / 20, 150.0), True))  # TTFT-bound everywhere
    held = replace(_figure("split", 100.0, "3:1"), chunk=2048)
    rows = [screen_row(held, _probe_holding_up_to(100, [])(held))]
    judged = sweep_settings(rows, [Setting(2048, 256)], 0.1, {}, probe=edge,
                            ceiling=lambda model, workload: None)  # fmt: skip
    # 2048 holds 102.4 at most; 4096 climbs to 146.41 (150 at most), 8192 serves no more and
    # fails on TTFT again, which ends the refinement.
    assert [(f.chunk, round(f.rate, 2)) for f in calls] == [
        (2048, 110.0), (4096, 110.0), (4096, 121.0), (4096, 133.1), (4096, 146.41),
        (4096, 161.05), (8192, 161.05),
    ]  # fmt: skip
    assert highest_held(judged)["chunk"] == 4096


def test_auto_climbs_last_on_a_figure_another_family_reached_in_the_same_sweep() -> None:
    """Colocated's new best setting, found by this sweep (8B mix loose: chunk 1792, above
    `auto`'s 216 at 1024), is offered to `auto` as hybrid workers in the same run."""
    limits = {("colocated", 1024): 100.0, ("colocated", 512): 120.0, ("hybrid", 1024): 100.0,
              ("hybrid", 512): 118.0}  # fmt: skip
    calls: list[Figure] = []

    def probe(figure: Figure) -> PairedProbe:
        calls.append(figure)
        holds = figure.rate <= limits.get((figure.split, figure.chunk), 0.0)
        return PairedProbe(figure.family, figure.split, figure.rate, 100, 95 if holds else 40,
                           300.0, 500.0, 20.0, 0.0)  # fmt: skip

    def held(family: str, split: str) -> dict:
        figure = replace(_figure(family, 100.0, split), chunk=1024)
        return screen_row(figure, _probe_holding_up_to(100.0, [])(figure))

    rows = [held("auto", "hybrid"), held("colocated", "colocated")]
    judged = sweep_settings(rows, [Setting(512, 256)], 0.05, {row_key(r): r for r in rows},
                            probe=probe, ceiling=lambda model, workload: None)  # fmt: skip
    families = [f.family for f in calls]
    assert families == sorted(families, key=lambda family: family == "auto")  # `auto` last
    best = highest_held(r for r in judged if r["family"] == "auto")
    assert (best["split"], best["chunk"], round(best["rate"], 2)) == ("hybrid", 512, 115.76)
