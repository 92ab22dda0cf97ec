"""The coverage table gathers the cells of several `--suite --json` files, in the suite's order."""

from __future__ import annotations

from pathlib import Path

from pdserve.bench.simulation.disagg_suite.command import _write_json
from pdserve.bench.simulation.disagg_suite.coverage import (
    coverage_cells,
    coverage_markdown,
    figure_text,
)
from pdserve.bench.simulation.disagg_suite.plots import summary_markdown
from pdserve.bench.simulation.disagg_suite.suite import Cell, FamilyBest, Setting


def _cell(model: str, workload: str, slo: str, **goodputs: float) -> Cell:
    cell = Cell(model, workload, slo, ceiling=100.0)
    for family, goodput in goodputs.items():
        split = "colocated 8" if family == "colocated" else "1P:7D"
        cell.families[family] = FamilyBest(family, goodput, split, Setting(2048, 256))
    return cell


def test_cells_of_every_file_in_suite_order_with_targets_and_bursts(tmp_path: Path) -> None:
    folder = tmp_path / "coverage"
    _write_json(folder / "8b-loose.json", [_cell("8b", "chat", "loose", colocated=50, auto=40)])
    _write_json(folder / "70b-tight.json", [
        _cell("70b", "rag", "tight-tpot", colocated=2, split=8, auto=8.2),
        _cell("70b", "code", "tight-ttft", colocated=120, split=90, auto=125),
    ])  # fmt: skip
    cells = coverage_cells(folder)
    assert [(c["model"], c["workload"], c["slo"]) for c in cells] == [
        ("8b", "chat", "loose"), ("70b", "code", "tight-ttft"), ("70b", "rag", "tight-tpot"),
    ]  # fmt: skip
    rows = coverage_markdown(cells).splitlines()[2:]
    assert "| 8b | chat | loose | 50.0 (chunk 2048) | - | 40.0 (1P:7D, chunk 2048) |" in rows[0]
    assert "auto>=0.95x best static" not in rows[0]  # no split measured: not checked
    assert "| 0.80 | 0.80 | auto>=1.0x colocated |" in rows[0]
    assert rows[1].endswith("| 1.04 | 1.04 | none | 100 (above: colocated, auto) |")
    assert "| 1.02 | 4.10 | none | 100 |" in rows[2]
    # The plots' summary carries the coverage table of DIR/coverage.
    assert coverage_markdown(cells) in summary_markdown(tmp_path)


def test_a_cell_in_several_files_is_the_latest_sessions_whatever_the_files_times(
    tmp_path: Path,
) -> None:
    # Written in this order; a clone gives every file the checkout's time, so the names decide.
    for name, goodput in [("70b-tight-tpot", 10), ("70b-all-session6", 20),
                          ("70b-all-session7", 30), ("70b-all-session7-sweep", 40)]:  # fmt: skip
        _write_json(tmp_path / f"{name}.json", [_cell("70b", "chat", "loose", colocated=goodput)])
    [cell] = coverage_cells(tmp_path)
    assert cell["families"]["colocated"]["goodput"] == 40


def test_a_what_if_on_a_costlier_push_is_not_a_suite_figure(tmp_path: Path) -> None:
    _write_json(tmp_path / "70b-chat.json", [_cell("70b", "chat", "loose", colocated=40)])
    costly = _cell("70b", "chat", "loose", colocated=10)
    costly.push_fixed_ms = 5.0  # --push-fixed-ms 5, written later
    _write_json(tmp_path / "70b-chat-session99.json", [costly])
    [cell] = coverage_cells(tmp_path)
    assert cell["families"]["colocated"]["goodput"] == 40


def test_a_figure_names_its_batch_limit_where_it_is_not_the_usual_256() -> None:
    assert figure_text(35.12, "7P:1D", 512, 128) == "35.1 (7P:1D, chunk 512 batch 128)"
    assert figure_text(1150.07, "", 1024, 256) == "1150 (chunk 1024)"
    assert figure_text(2.5, "3P:1D (TP 4:4)", 2048) == "2.5 (3P:1D, chunk 2048)"
