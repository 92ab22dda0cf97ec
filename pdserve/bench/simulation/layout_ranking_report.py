"""The table `pdserve bench layout-ranking` prints: each workload's goodputs, real and
simulated, which layout each puts first, and whether they agree."""

from __future__ import annotations

from typing import Any

from pdserve.bench.simulation.layout_ranking_sim import LAYOUTS


def ranking_table(result: dict) -> Any:
    from rich.table import Table

    slo = result["slo"]
    table = Table(
        title="1P:1D vs 2 colocated: goodput req/s, real (CPU) and simulated (profile fitted "
        f"here); TTFT <= {slo['ttft_ms']:g} ms, TPOT <= {slo['tpot_ms']:g} ms, "
        f"{slo['attainment']:.0%} attainment"
    )
    names = " / ".join(LAYOUTS)
    for column in ("workload", "rates", f"real {names}", f"sim {names}", "first real", "first sim",
                   "agree"):  # fmt: skip
        table.add_column(column, justify="right")
    for name, w in result["workloads"].items():
        table.add_row(
            name,
            ", ".join(f"{r:.3g}" for r in w["rates"]),
            *(
                " / ".join(_goodput(w[system][layout]) for layout in LAYOUTS)
                for system in ("real", "sim")
            ),
            _first(w["rank_real"]),
            _first(w["rank_sim"]),
            "yes" if w["agree"] else "NO",
        )
    return table


def _goodput(curve: dict) -> str:
    """'>=' where no rate measured fell below the attainment (a lower bound)."""
    held = all(p["attainment"] >= curve["attainment_target"] for p in curve["points"])
    return f"{'>=' if held else ''}{curve['goodput']:.3g}"


def _first(ranking: dict) -> str:
    return f"{ranking['first'] or 'tie'} {ranking['ratio']:.2f}x"
