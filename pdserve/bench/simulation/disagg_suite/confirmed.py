"""The confirmed coverage table: per cell, each family's highest documented figure that held its
steady probe in a screen (screen.py), and issue 49's targets judged on those figures alone.

A held figure is a rate the layout sustains, so each entry is a lower bound of the family's
goodput: within the search's precision of it where the figure came from a confirming search
(2% in sessions 10-14), further below where the highest figures of a short-probe search were
bursts and the screen reached a lower one.
"""

from __future__ import annotations

from collections.abc import Iterable

from pdserve.bench.simulation.disagg_suite.coverage import figure_text, rate_text
from pdserve.bench.simulation.disagg_suite.screen import attainment_text, highest_held
from pdserve.bench.simulation.disagg_suite.suite import (
    MODELS,
    REQUESTS_PER_WORKER,
    SLOS,
    Cell,
    FamilyBest,
    Setting,
)
from pdserve.bench.simulation.disagg_suite.targets import targets
from pdserve.bench.simulation.disagg_suite.workloads import NAMED_WORKLOADS

SCREEN = "screen.jsonl"  # in the coverage folder: the screen the summary's table reads
COLUMNS = ["colocated", "split", "auto", "threshold", "conditional"]
HEADER = ["model", "workload", "SLO", "colocated", "best split", "auto", "threshold:16",
          "conditional", "auto / best static", "auto / colocated", "targets missed",
          "figures held / probed"]  # fmt: skip


def confirmed_markdown(rows: list[dict], unserved: Iterable[tuple[str, str, str]] = ()) -> str:
    """The table of a screen's rows; `unserved`: cells (model, workload, SLO) where no search
    found any rate for any family, each a row of zeros (nothing there to screen)."""
    # A cell screened on samples of two sizes is two rows: agentic, mix and phases differ.
    by_cell: dict[tuple, dict[str, list[dict]]] = {}
    for row in rows:
        key = (row["model"], row["workload"], row["slo"], row["requests_per_worker"])
        by_cell.setdefault(key, {}).setdefault(row["family"], []).append(row)
    zeros = {(*cell, REQUESTS_PER_WORKER) for cell in unserved} - by_cell.keys()
    by_cell.update(dict.fromkeys(zeros, {}))
    order = {name: i for i, name in enumerate([*MODELS, *NAMED_WORKLOADS, *SLOS])}
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    for key in sorted(by_cell, key=lambda k: [*(order[n] for n in k[:3]), k[3]]):
        families = by_cell[key]
        held = {f: highest_held(rs) for f, rs in families.items()}
        model, workload, slo, per_worker = key
        probed = [r for rs in families.values() for r in rs]
        judged = confirmed_cell(probed, model, workload, slo, per_worker)
        if per_worker != REQUESTS_PER_WORKER:
            workload = f"{workload} ({per_worker} per worker)"
        auto, static = judged.goodput("auto"), judged.best_static
        missed = [name for name, ok in targets(judged).items() if not ok]
        row = [
            model, workload, slo,
            *("0" if key in zeros else _entry(families.get(f, []), held.get(f), f != "colocated")
              for f in COLUMNS),
            _ratio(auto, static), _ratio(auto, judged.goodput("colocated")),
            ", ".join(missed) or "none", f"{sum(r['holds'] for r in probed)} / {len(probed)}",
        ]  # fmt: skip
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def confirmed_cell(
    rows: Iterable[dict], model: str, workload: str, slo: str, requests_per_worker: int
) -> Cell:
    """The cell as a screen confirmed it: each family at its highest held figure, on the
    layout and engine setting it held on (families with none held are left out)."""
    by_family: dict[str, list[dict]] = {}
    for row in rows:
        if (row["model"], row["workload"], row["slo"], row["requests_per_worker"]) == (
            model, workload, slo, requests_per_worker
        ):  # fmt: skip
            by_family.setdefault(row["family"], []).append(row)
    families = {}
    for family, family_rows in by_family.items():
        if held := highest_held(family_rows):
            setting = Setting(held["chunk"], held["batch"])
            families[family] = FamilyBest(
                family, held["rate"], held["layout"], setting,
                ttft_mean_ms=held["ttft_mean_ms"], tpot_p90_ms=held["tpot_p90_ms"],
                remote_share=held["remote_share"],
            )  # fmt: skip
    return Cell(model, workload, slo, families)


def _entry(rows: list[dict], held: dict | None, with_layout: bool) -> str:
    """The held figure with where it held; or how far the highest figure probed fell short."""
    if not rows:
        return "-"
    if held is None:
        top = max(rows, key=lambda r: r["rate"])
        return f"none held ({len(rows)} probed; {rate_text(top['rate'])}: {attainment_text(top)})"
    return figure_text(held["rate"], held["layout"] if with_layout else "", held["chunk"],
                       held["batch"])  # fmt: skip


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if a > 0 and b > 0 else "-"
