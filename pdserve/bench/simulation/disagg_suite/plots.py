"""`--suite --plot DIR`: per model and workload, goodput against offered rate of every layout
family (one panel per SLO pair), and one summary table of every cell plotted in DIR.

A `<model>-<workload>.json` in DIR keeps the curves; a later run into the same DIR replaces the
families it measured and keeps the others, so families searched by separate commands (as the
documented runs search each family at its own split) end up on one plot. The summary table
(SUMMARY, in DIR) is rewritten from every such file after each cell (or by `--summary DIR`),
followed by the table of every cell's confirmed figures when DIR/coverage holds a screen
(confirmed.py), and by the coverage table of the suite's `--json` files in DIR/coverage
(coverage.py), when there are any.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from pdserve.bench.simulation.disagg_suite.confirmed import SCREEN, confirmed_markdown
from pdserve.bench.simulation.disagg_suite.coverage import (
    COVERAGE_DIR,
    coverage_cells,
    coverage_markdown,
)
from pdserve.bench.simulation.disagg_suite.curves import Curve
from pdserve.bench.simulation.disagg_suite.screen import read_rows
from pdserve.bench.simulation.disagg_suite.suite import FAMILIES, SLOS, Cell
from pdserve.planner.probe import SLO

SUMMARY = "summary.md"
ATTAINMENT = SLO.attainment  # DistServe's goodput: the highest rate at which 90% meet both SLOs


def write_cell(out_dir: Path, cell: Cell, curves: list[Curve]) -> Path:
    """Merges the cell's curves into its model-workload file, redraws its PNG and the summary;
    returns the PNG's path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"{cell.model}-{cell.workload}"
    data_path = out_dir / f"{stem}.json"
    data = json.loads(data_path.read_text()) if data_path.exists() else {}
    by_family = data.setdefault(cell.slo, {})
    for curve in curves:
        by_family[curve.family] = asdict(curve)
    data_path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    png = out_dir / f"{stem}.png"
    _draw(data, f"{cell.model}, {cell.workload}", png)
    (out_dir / SUMMARY).write_text(summary_markdown(out_dir), encoding="utf-8")
    return png


def known_goodputs(out_dir: Path, cell: Cell) -> tuple[float, ...]:
    """The goodputs of the cell's families that earlier runs left in out_dir."""
    data_path = out_dir / f"{cell.model}-{cell.workload}.json"
    data = json.loads(data_path.read_text()) if data_path.exists() else {}
    return tuple(curve["goodput"] for curve in data.get(cell.slo, {}).values())


def _draw(data: dict, title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only: never needs a display
    import matplotlib.pyplot as plt

    slos = [slo for slo in SLOS if slo in data]
    fig, axes = plt.subplots(1, len(slos), figsize=(4.2 * len(slos), 3.6), squeeze=False)
    for ax, slo in zip(axes[0], slos, strict=True):
        top = 0.0
        for family in FAMILIES:
            curve = data[slo].get(family)
            if curve is None:
                continue
            rates = [rate for rate, _ in curve["points"]]
            met = [rate * fraction for rate, fraction in curve["points"]]
            top = max(top, *rates)
            label = f"{family}: {curve['label']}"
            (line,) = ax.plot(rates, met, marker="o", markersize=3, label=label)
            ax.plot([curve["goodput"]], [curve["goodput"]], marker="*", markersize=10,
                    color=line.get_color(), linestyle="none")  # fmt: skip
        ax.plot([0, top], [0, ATTAINMENT * top], color="grey", linestyle=":", linewidth=1)
        ttft, tpot = SLOS[slo]
        ax.set_title(f"{slo}: TTFT <= {ttft:g} ms, TPOT <= {tpot:g} ms", fontsize=9)
        ax.set_xlabel("offered req/s")
        ax.set_ylabel("req/s meeting both SLOs")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6, loc="upper left")
    fig.suptitle(f"{title}: goodput vs rate (star: goodput; dotted: 90% of the rate)", fontsize=9)
    fig.savefig(path, dpi=80, bbox_inches="tight")
    plt.close(fig)


def summary_markdown(out_dir: Path) -> str:
    """One row per cell plotted in out_dir: each family's goodput and x colocated."""
    header = ["model", "workload", "SLO", *FAMILIES, "auto / best static"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for data_path in sorted(out_dir.glob("*.json")):
        model, _, workload = data_path.stem.partition("-")
        data = json.loads(data_path.read_text())
        for slo in (s for s in SLOS if s in data):
            goodput = {family: curve["goodput"] for family, curve in data[slo].items()}
            colocated = goodput.get("colocated", 0.0)
            cells = [_figure(goodput, family, colocated) for family in FAMILIES]
            static = max(colocated, goodput.get("split", 0.0))
            auto = f"{goodput['auto'] / static:.2f}" if "auto" in goodput and static else "-"
            lines.append("| " + " | ".join([model, workload, slo, *cells, auto]) + " |")
    parts = ["\n".join(lines) + "\n"]
    coverage = out_dir / COVERAGE_DIR
    screened = read_rows(coverage / SCREEN)
    covered = coverage_cells(coverage) if coverage.is_dir() else []
    if screened:
        unserved = [(c["model"], c["workload"], c["slo"]) for c in covered
                    if not any(best["goodput"] for best in c["families"].values())]  # fmt: skip
        parts.append(f"## Every cell, confirmed ({COVERAGE_DIR}/{SCREEN}: each figure held its "
                     f"steady probe)\n\n{CONFIRMED_NOTE}\n\n"
                     f"{confirmed_markdown(list(screened.values()), unserved)}")  # fmt: skip
    if covered:
        parts.append(f"## Every cell as searched ({COVERAGE_DIR}/*.json, no curves; short "
                     f"probes, some figures bursts: read the table above)\n\n"
                     f"{coverage_markdown(covered)}")  # fmt: skip
    return "\n".join(parts)


# Above the confirmed table: what its figures are, and the command that rebuilds it.
CONFIRMED_NOTE = (
    "Per cell and family, the highest figure documented in this folder's suite JSON (at the "
    "cell's SLO pair or a tighter one) that keeps >= 90% of its steady probe within both SLOs "
    "(`pdserve bench sim-disagg --suite --screen FOLDER --json SCREEN`, "
    "pdserve/bench/simulation/disagg_suite/screen.py): a rate the layout sustains, so a lower "
    'bound of the family\'s goodput. "none held": every figure probed fell short (the '
    'highest\'s share within SLO; "< x": the probe stopped once its failure was certain); '
    '"-": no documented figure below the cell\'s compute ceiling; a row of 0: no search found '
    "a rate for any family."
)


def _figure(goodput: dict[str, float], family: str, colocated: float) -> str:
    if family not in goodput:
        return "-"
    figure = goodput[family]
    shown = f"{figure:.0f}" if figure >= 100 else f"{figure:.1f}"
    if not colocated or family == "colocated":
        return shown
    return f"{shown} ({figure / colocated:.2f}x)"
