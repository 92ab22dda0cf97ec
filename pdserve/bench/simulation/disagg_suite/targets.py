"""Issue 49's targets on one cell: `auto` >= 0.95x the best static layout (colocated or a
split, whichever is better) and >= 1.0x colocated; `auto`'s goodput >= each rule's."""

from __future__ import annotations

from pdserve.bench.simulation.disagg_suite.suite import Cell

AUTO_VS_STATIC, AUTO_VS_COLOCATED = 0.95, 1.0
# Two searches that probed the same rates reach them along different products of steps
# (each starts from its own estimate): equal goodputs may differ in the last bits (70B mix,
# TPOT <= 20 ms: auto 28.55874371656338, threshold:16 28.558743716563388, the same probe).
SAME_RATE = 1e-9


def _at_least(goodput: float, bound: float) -> bool:
    return goodput >= bound * (1 - SAME_RATE)


def targets(cell: Cell) -> dict[str, bool]:
    """Issue 49's checks on one cell, for the families it measured."""
    auto, checks = cell.goodput("auto"), {}
    if "auto" not in cell.families:
        return checks
    if {"colocated", "split"} <= cell.families.keys():
        checks["auto>=0.95x best static"] = _at_least(auto, AUTO_VS_STATIC * cell.best_static)
    if "colocated" in cell.families:
        checks["auto>=1.0x colocated"] = _at_least(
            auto, AUTO_VS_COLOCATED * cell.goodput("colocated")
        )
    for rule in ("threshold", "conditional"):
        if rule in cell.families:
            checks[f"auto>={rule}"] = _at_least(auto, cell.goodput(rule))
    return checks
