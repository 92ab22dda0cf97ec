"""`sim-disagg --suite --plot DIR`: goodput-vs-rate curves of one cheap cell, the PNG per model
and workload, and the summary table, merged over runs into the same DIR."""

from __future__ import annotations

import json

import pytest

from pdserve.bench.simulation.disagg_suite.curves import CURVE_FRACTIONS, cell_curves
from pdserve.bench.simulation.disagg_suite.plots import SUMMARY, write_cell
from pdserve.bench.simulation.disagg_suite.suite import Cell, Setting, SuiteOptions, run_cell

OPTIONS = SuiteOptions((Setting(512, 64),), requests_per_worker=30, precision=0.2,
                       families=("colocated", "split"), steady_probes=False)  # fmt: skip


@pytest.fixture(scope="module")
def cell_and_curves():
    cell = run_cell("70b", "code", "loose", OPTIONS)
    return cell, cell_curves(cell, OPTIONS)


def test_each_family_is_offered_the_same_rates_and_meets_the_slos_at_its_goodput(
    cell_and_curves,
):
    cell, curves = cell_and_curves
    assert [c.family for c in curves] == ["colocated", "split"]
    top = max(cell.goodput(f) for f in cell.families)
    for curve in curves:
        best = cell.families[curve.family]
        rates = [rate for rate, _ in curve.points]
        expected = sorted(
            {round(r, 3) for r in (*(f * top for f in CURVE_FRACTIONS), best.goodput)}
        )
        assert rates == expected and curve.goodput == best.goodput
        assert all(0.0 <= fraction <= 1.0 for _, fraction in curve.points)
        # The search's passing probe at the goodput was these requests at this rate: run to
        # their end they still meet the 90% bar.
        at_goodput = dict(curve.points)[round(best.goodput, 3)]
        assert at_goodput >= 0.9, curve
        assert curve.label.startswith(best.split)


def test_the_plot_and_the_summary_keep_families_of_earlier_runs(cell_and_curves, tmp_path):
    cell, curves = cell_and_curves
    colocated, split = curves
    write_cell(tmp_path, cell, [split])
    png = write_cell(tmp_path, cell, [colocated])  # a later run of the other family
    assert png == tmp_path / "70b-code.png" and 0 < png.stat().st_size <= 100_000
    data = json.loads((tmp_path / "70b-code.json").read_text())
    assert set(data["loose"]) == {"colocated", "split"}
    rows = [line for line in (tmp_path / SUMMARY).read_text().splitlines() if "| 70b |" in line]
    assert len(rows) == 1
    cells = [cell.strip() for cell in rows[0].strip("|").split("|")]
    assert cells[:3] == ["70b", "code", "loose"] and cells[5:] == ["-"] * 4  # not measured
    assert float(cells[3]) == pytest.approx(colocated.goodput, abs=0.5)
    figure, ratio = cells[4].split()
    assert float(figure) == pytest.approx(split.goodput, abs=0.5)
    assert ratio == f"({split.goodput / colocated.goodput:.2f}x)"


def test_a_later_run_offers_the_rates_of_the_families_measured_earlier(cell_and_curves):
    cell, curves = cell_and_curves
    split_only = Cell(cell.model, cell.workload, cell.slo, {"split": cell.families["split"]})
    [curve] = cell_curves(split_only, OPTIONS, known=(cell.goodput("colocated"),))
    assert curve.points == next(c for c in curves if c.family == "split").points
