"""The coverage table: every cell of the suite's `--json` files in one markdown table.

A run of the whole suite does not fit one command on a small machine, so it is split into
commands by model, SLO and workloads, each writing its own `--json` into one folder
(COVERAGE_DIR under the `--plot` folder): this table gathers them, cells in the suite's order,
each family's goodput with the split and chunk budget it reached it at, the targets of issue 49
and the families whose goodput lies above the compute ceiling (a burst, not a rate).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from pdserve.bench.simulation.disagg_suite.suite import MODELS, SLOS, Cell, FamilyBest
from pdserve.bench.simulation.disagg_suite.targets import targets
from pdserve.bench.simulation.disagg_suite.workloads import NAMED_WORKLOADS

COVERAGE_DIR = "coverage"
HEADER = ["model", "workload", "SLO", "colocated", "best split", "auto", "threshold:16",
          "conditional", "auto / best static", "auto / colocated", "targets missed",
          "ceiling"]  # fmt: skip

# The batch limit most figures were searched at: named in the tables only where another was.
DEFAULT_BATCH = 256


def coverage_cells(folder: Path) -> list[dict]:
    """Every cell of the `--json` files in `folder`, in the suite's order (a cell measured
    twice: the later file's, by `_written_order`)."""
    by_key = {}
    for path in sorted(folder.glob("*.json"), key=_written_order):
        for cell in json.loads(path.read_text(encoding="utf-8")):
            if cell.get("push_fixed_ms"):
                continue  # a what-if on a costlier link (--push-fixed-ms), not the suite's cluster
            by_key[cell["model"], cell["workload"], cell["slo"]] = cell
    order = {name: i for i, name in enumerate([*MODELS, *NAMED_WORKLOADS, *SLOS])}
    return [by_key[k] for k in sorted(by_key, key=lambda k: [order[n] for n in k])]


def _written_order(path: Path) -> tuple[int, bool, str]:
    """The order the files were written in, from their names (a clone's files all bear the
    time of the checkout): "...-sessionN" by N (none: before the sessions were named), a
    "-sweep" after the session's plain file."""
    session = re.search(r"session(\d+)", path.stem)
    return (int(session[1]) if session else 0, path.stem.endswith("-sweep"), path.stem)


def coverage_markdown(cells: list[dict]) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    for cell in cells:
        families = cell["families"]
        judged = _judged(cell)
        colocated = judged.goodput("colocated")
        auto, static = judged.goodput("auto"), judged.best_static
        missed = [name for name, ok in targets(judged).items() if not ok]
        ceiling = cell.get("ceiling")
        row = [
            cell["model"], cell["workload"], cell["slo"],
            _figure(families.get("colocated"), with_split=False),
            _figure(families.get("split")), _figure(families.get("auto")),
            _figure(families.get("threshold")), _figure(families.get("conditional")),
            _ratio(auto, static), _ratio(auto, colocated),
            ", ".join(missed) or "none",
            "-" if ceiling is None else rate_text(ceiling) + _bursts(cell),
        ]  # fmt: skip
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def _judged(cell: dict) -> Cell:
    """The cell's goodputs, to be judged by today's targets (not those of the run's code)."""
    families = {f: FamilyBest(f, best["goodput"]) for f, best in cell["families"].items()}
    return Cell(cell["model"], cell["workload"], cell["slo"], families)


def rate_text(value: float) -> str:
    return f"{value:.0f}" if value >= 100 else f"{value:.1f}" if value >= 1 else f"{value:.2f}"


def _figure(best: dict | None, with_split: bool = True) -> str:
    """A family's goodput, with where it was reached (split, chunk budget)."""
    if best is None:
        return "-"
    if not best["goodput"]:
        return "0"
    setting = best["setting"]
    return figure_text(best["goodput"], best["split"] if with_split else "", setting["chunk"],
                       setting["batch"])  # fmt: skip


def figure_text(rate: float, layout: str, chunk: int, batch: int = DEFAULT_BATCH) -> str:
    """ "115.6 (1P:3D, chunk 512)": a goodput and where it was reached (no layout: colocated;
    the batch limit named where it is not the suite's usual 256)."""
    setting = f"chunk {chunk}" + (f" batch {batch}" if batch != DEFAULT_BATCH else "")
    where = ", ".join(w for w in (layout.split(" (")[0], setting) if w)
    return f"{rate_text(rate)} ({where})"


def _ratio(a: float, b: float) -> str:
    if b <= 0:
        return "-"
    return f"{a / b:.2f}"


def _bursts(cell: dict) -> str:
    above = cell.get("above_ceiling") or []
    return f" (above: {', '.join(above)})" if above else ""
