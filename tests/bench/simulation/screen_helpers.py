"""Figures and fake probes shared by the screen's and the setting sweep's tests."""

from __future__ import annotations

from collections.abc import Callable

from pdserve.bench.simulation.disagg_suite.paired import PairedProbe
from pdserve.bench.simulation.disagg_suite.screen import Figure


def probe_holding_up_to(limit: float, calls: list[Figure]) -> Callable[[Figure], PairedProbe]:
    """A probe that holds every rate up to `limit`, recording each figure it is offered."""

    def probe(figure: Figure) -> PairedProbe:
        calls.append(figure)
        good = 95 if figure.rate <= limit else 40
        return PairedProbe(figure.family, f"{figure.split} layout", figure.rate, 100, good,
                           300.0, 500.0, 20.0, 0.5)  # fmt: skip

    return probe


def probe_by_layout(limits: dict[tuple, float], calls: list[Figure],
                    remote_share: float = 1.0) -> Callable[[Figure], PairedProbe]:  # fmt: skip
    """A probe that holds up to `limits[(split, chunk)]` (nothing where a layout and chunk has
    no limit), breaking TTFT more than TPOT when it fails."""

    def probe(figure: Figure) -> PairedProbe:
        calls.append(figure)
        holds = figure.rate <= limits.get((figure.split, figure.chunk), 0.0)
        return PairedProbe(figure.family, figure.split, figure.rate, 100, 95 if holds else 40,
                           300.0, 500.0, 20.0, remote_share)  # fmt: skip

    return probe


def figure_at(family: str, rate: float, split: str = "1:3") -> Figure:
    return Figure("70b", "code", "loose", family, split, 512, 256, rate, "x.json")
