"""`sim-disagg --suite --screen FILES`: which documented figures hold on today's code.

A suite `--json` file records, per cell and family, every (layout, engine setting) it searched
and the goodput each reached. Figures searched with short probes, or by an older search, can
be bursts (issue 49, session 13: a third of one session's `auto` figures kept under 20% of
their requests within SLO when run to the end). The screen takes every such figure of the
files (each also under every looser SLO pair), per cell and family from the highest rate down,
and runs its steady probe at that rate, layout and setting (paired.py's probe) until its
verdict is certain. The first one that keeps >= 90% within both SLOs is the family's confirmed
figure: a rate the layout sustains, so a lower bound of the family's goodput on that cell;
`refine` bisects the gap above it, and `sweep_settings` tries its layout at the engine settings
a search did not (`--screen-settings`), chunk budgets between and past the grid's included.
Each probe is one line of a JSONL file; a later run reads it and probes only what it lacks, so a
screen can be split across processes and resumed.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, replace
from functools import cache
from pathlib import Path

from pdserve.bench.simulation.disagg_suite.paired import PairedProbe, paired_attainment
from pdserve.bench.simulation.disagg_suite.suite import (
    REQUESTS_PER_WORKER,
    SLOS,
    Setting,
    SuiteOptions,
    cell_sample,
    sample_ceiling,
)
from pdserve.planner.probe import SLO

HOLDS = SLO.attainment  # the search's bar, DistServe's: >= 90% of the requests within both SLOs
# A searched entry's name: "<layout> chunk C batch B", the layout "2P:6D", "2P:2D (TP 4:4)",
# "hybrid 8", "colocated 4 (TP 4)".
_ENTRY = re.compile(r"^(?P<layout>.+?) chunk (?P<chunk>\d+) batch (?P<batch>\d+)$")
_SPLIT = re.compile(r"^(\d+)P:(\d+)D\b")


@dataclass(frozen=True)
class Figure:
    """One documented goodput: a family on one layout and engine setting of one cell."""

    model: str
    workload: str
    slo: str
    family: str
    split: str  # "P:D", "hybrid" or "colocated" (paired.family_layout's names)
    chunk: int
    batch: int
    rate: float
    source: str  # the first file that documents it
    # The probe sample's block (suite.cell_sample): agentic, mix and phases repeat their trace
    # every requests_per_worker x (fewest workers) requests, so their sample depends on it.
    requests_per_worker: int = REQUESTS_PER_WORKER

    @property
    def key(self) -> tuple:
        return (self.model, self.workload, self.slo, self.family, self.split, self.chunk,
                self.batch, round(self.rate, 6), self.requests_per_worker)  # fmt: skip


def layout_key(layout: str) -> str:
    """The --splits name of a layout as the suite JSON names it."""
    if layout.startswith("colocated"):
        return "colocated"
    if layout.startswith("hybrid"):
        return "hybrid"
    match = _SPLIT.match(layout)
    if not match:
        raise ValueError(f"not a layout name: {layout!r}")
    return f"{match[1]}:{match[2]}"


def documented_figures(paths: Iterable[Path]) -> list[Figure]:
    """Every positive goodput the suite JSON files record (the best and every searched entry),
    once each; files that are not suite `--json` output are skipped."""
    figures: dict[tuple, Figure] = {}
    for path in paths:
        document = json.loads(path.read_text(encoding="utf-8"))
        if not (isinstance(document, list) and all("families" in c for c in document)):
            continue
        for cell in document:
            for family, best in cell["families"].items():
                for name, rate in best.get("searched", {}).items():
                    match = _ENTRY.match(name)
                    if not rate or not match:
                        continue
                    figure = Figure(
                        cell["model"], cell["workload"], cell["slo"], family,
                        layout_key(match["layout"]), int(match["chunk"]), int(match["batch"]),
                        rate, str(path),
                    )  # fmt: skip
                    figures.setdefault(figure.key, figure)
    return list(figures.values())


def with_looser_slos(figures: list[Figure]) -> list[Figure]:
    """The figures, and each again under every SLO pair at least as loose as its own: a rate a
    layout serves within tighter SLOs it serves within looser ones (colocated on 70B rag: 6.71
    req/s at TPOT <= 20 ms, where every figure documented at the loose pair fails)."""
    found = {f.key: f for f in figures}
    for f in figures:
        ttft, tpot = SLOS[f.slo]
        for slo, (looser_ttft, looser_tpot) in SLOS.items():
            if slo != f.slo and looser_ttft >= ttft and looser_tpot >= tpot:
                copy = replace(f, slo=slo, source=f"{f.source} ({f.slo})")
                found.setdefault(copy.key, copy)
    return list(found.values())


def suite_files(paths: Iterable[str]) -> list[Path]:
    """The JSON files named, folders searched recursively, in a stable order."""
    found = []
    for name in paths:
        path = Path(name)
        found.extend(sorted(path.rglob("*.json")) if path.is_dir() else [path])
    return found


Probe = Callable[[Figure], PairedProbe]


def probe_figure(figure: Figure) -> PairedProbe:
    """The figure's steady probe at its rate, layout and setting, until its verdict is certain
    (a burst's fails within its first few hundred requests; run to the end, a probe of 8192 far
    past saturation takes minutes)."""
    setting = Setting(figure.chunk, figure.batch)
    split = "hybrid" if figure.split == "colocated" else figure.split  # colocated: ignored
    options = SuiteOptions(settings=(setting,), requests_per_worker=figure.requests_per_worker)
    [probe] = paired_attainment(figure.model, figure.workload, figure.slo, [figure.family],
                                split, setting, [figure.rate], options, to_end=False)  # fmt: skip
    return probe


@cache
def cell_ceiling(model: str, workload: str) -> float | None:
    """The cell's compute ceiling (suite.Cell.ceiling): no layout sustains a rate above it."""
    return sample_ceiling(
        model, cell_sample(model, workload, SuiteOptions(settings=(Setting(512, 256),)))
    )


def screen(
    figures: list[Figure],
    done: dict[tuple, dict],
    depth: int,
    probe: Probe = probe_figure,
    on_row: Callable[[dict], None] | None = None,
    ceiling: Callable[[str, str], float | None] = cell_ceiling,
    refine: float = 0.0,
) -> list[dict]:
    """Per cell and family, its figures from the highest rate down until one holds or `depth`
    of them failed; `done` (rows of an earlier screen, by Figure.key) are not probed again, and
    figures above the cell's compute ceiling (bursts by arithmetic) not at all. `refine` > 0:
    then `_refine` narrows the gap above the figure that held. Returns the rows of every figure
    judged, earlier or now."""
    by_family: dict[tuple, list[Figure]] = {}
    for f in figures:
        top = ceiling(f.model, f.workload)
        if top is None or f.rate <= top:
            by_family.setdefault((f.model, f.workload, f.slo, f.family), []).append(f)
    rows: list[dict] = []
    judge = _judge(done, probe, on_row, rows)
    for group in by_family.values():
        judged = []
        for figure in sorted(group, key=lambda f: -f.rate)[:depth]:
            judged.append((figure, judge(figure)))
            if judged[-1][1]["holds"]:
                break
        if refine > 0 and len(judged) > 1 and judged[-1][1]["holds"]:
            _refine(judged[-1][0].rate, [f for f, _ in judged[:-1]], refine, judge)
    return rows


def _judge(
    done: dict[tuple, dict], probe: Probe, on_row: Callable[[dict], None] | None, rows: list[dict]
) -> Callable[[Figure], dict]:
    """A figure's row: an earlier one from `done` or this judge's, else its probe's (passed to
    `on_row`); each figure judged is also appended to `rows`, once."""

    known = dict(done)  # and each figure probed here: a rung offered twice is probed once
    listed: set[tuple] = set()

    def judge(figure: Figure) -> dict:
        row = known.get(figure.key)
        if row is None:
            row = known[figure.key] = screen_row(figure, probe(figure))
            if on_row is not None:
                on_row(row)
        if figure.key not in listed:
            listed.add(figure.key)
            rows.append(row)
        return row

    return judge


def highest_held(rows: Iterable[dict]) -> dict | None:
    """The row of the highest rate that held, of one cell and family's rows."""
    return max((r for r in rows if r["holds"]), key=lambda r: r["rate"], default=None)


def sweep_settings(
    rows: list[dict],
    settings: Iterable[Setting],
    step: float,
    done: dict[tuple, dict],
    probe: Probe = probe_figure,
    on_row: Callable[[dict], None] | None = None,
    ceiling: Callable[[str, str], float | None] = cell_ceiling,
) -> list[dict]:
    """Point 0's sweep where a search tried one engine setting: per cell and family of `rows`,
    the layout of its highest held figure (of `rows` and `done`: a sweep goes on from where an
    earlier one left it) at its own setting and then each of `settings` in turn, offered the
    best rate held so far raised by `step`, and raised again while it holds (up to the cell's
    compute ceiling). A setting that serves no more fails its first probe; one that serves more
    takes the lead, and the next setting must beat it. Its own setting is climbed too: the
    figure is the top of a ladder of another step (a finer step narrows it). A rate the same
    step probed before is not probed again, so a second run probes only the settings that were
    not yet offered the best rate.
    `auto` then climbs the same way on the layout and setting of each other family's highest
    held figure of the cell in `done` or this sweep, which takes `auto` last (a P:D split, or
    hybrid workers at colocated's setting; its own ones are climbed already), and is then
    offered the rate that family held there when its ladder stopped below it (ladders from
    different rates have different rungs: at the rule's own rate the two are compared at an
    equal rate). The router's choice runs on any layout, and a search that tried `auto` on
    other layouts or settings than a rule's cannot say it is worse there. Last, every family's
    chunk budget is refined between the grid's chunks and past its edges (`_refine_chunk`).
    Returns the rows judged."""
    judged: list[dict] = []
    judge = _judge(done, probe, on_row, judged)
    earlier = _by_family(done.values())
    # `auto` last: it climbs on the other families' layouts as this sweep leaves them.
    for key, group in sorted(_by_family(rows).items(), key=lambda item: item[0][3] == "auto"):
        held = highest_held([*group, *earlier.get(key, [])])
        if held is None:
            continue
        figure = _figure_of(held)
        top = ceiling(figure.model, figure.workload)
        own = Setting(figure.chunk, figure.batch)
        ladder = [own, *(s for s in settings if s != own)]
        source = f"setting sweep of {figure.split} chunk {figure.chunk} batch {figure.batch}"
        best = _climb(replace(figure, source=source), ladder, figure.rate, step, top, judge)
        if figure.family == "auto":
            climbed = {(figure.split, s.chunk, s.batch) for s in ladder}
            for peer in _peer_layouts(_by_family([*done.values(), *judged]), key):
                borrowed = replace(peer, family="auto",
                                   source=f"auto on {peer.family}'s {peer.split} layout")  # fmt: skip
                if (peer.split, peer.chunk, peer.batch) not in climbed:
                    best = _climb(borrowed, [Setting(peer.chunk, peer.batch)], best, step, top,
                                  judge)  # fmt: skip
                if peer.rate > best and judge(replace(borrowed, rate=peer.rate))["holds"]:
                    best = peer.rate
        family_rows = [*group, *earlier.get(key, []), *(r for r in judged if _family_key(r) == key)]
        leader = _figure_of(highest_held(family_rows))
        # Every chunk this family was probed at on the leader's layout, an earlier refinement's
        # too: a second sweep takes the same steps from the rows and probes none of them again.
        grid = {r["chunk"] for r in family_rows if r["split"] == leader.split}
        _refine_chunk(replace(leader, source=f"chunk refined from {leader.chunk}"), grid, step,
                      top, judge)  # fmt: skip
    return judged


def _family_key(row: dict) -> tuple:
    return (row["model"], row["workload"], row["slo"], row["family"], row["requests_per_worker"])


def _by_family(rows: Iterable[dict]) -> dict[tuple, list[dict]]:
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault(_family_key(row), []).append(row)
    return groups


def _figure_of(row: dict) -> Figure:
    return Figure(**{k: row[k] for k in Figure.__dataclass_fields__})


def _climb(figure: Figure, settings: list[Setting], best: float, step: float,
           top: float | None, judge: Callable) -> float:  # fmt: skip
    """`figure`'s layout at each setting in turn, from `best` up by `step` while it holds (to
    `top`); the best rate held, `best` if none beat it."""
    for setting in settings:
        rate = best * (1 + step)
        while top is None or rate <= top:
            candidate = replace(figure, chunk=setting.chunk, batch=setting.batch, rate=rate)
            if not judge(candidate)["holds"]:
                break
            best, rate = rate, rate * (1 + step)
    return best


CHUNK_GRAIN = 64  # the finest step between two chunk budgets the refinement tries
MAX_CHUNK = 16384  # how far doubling past the grid goes: 8x the default grid's largest chunk


def _binding_slo(row: dict) -> str:
    """Which SLO a failed row broke most: "ttft" or "tpot", by its p90 over the bound."""
    ttft, tpot = SLOS[row["slo"]]
    return "ttft" if row["ttft_p90_ms"] / ttft >= row["tpot_p90_ms"] / tpot else "tpot"


def _refine_chunk(leader: Figure, grid: set[int], step: float, top: float | None,
                  judge: Callable) -> None:  # fmt: skip
    """The chunk budget between the grid's powers of two and past its edges (issue 49, session
    18: 8B rag at TPOT <= 20 ms held most at chunk 576 and 640, between 512, whose prefill
    queue breaks TTFT, and 1024, whose chunks break TPOT). A bisection led by the SLO the
    leader breaks one step above its rate: a larger chunk drains prefill sooner (TTFT), a
    smaller one stalls decode less (TPOT). The nearest chunk tried that way, at that rate,
    breaking the same SLO ends it (moving that way does not relieve it); else the leader's
    layout and batch limit at the chunk halfway to it (a multiple of CHUNK_GRAIN; past the
    grid's edge, twice or half the leader's) climbs from the best rate, and leads if it holds
    more. It ends too where the next half is finer than the grain. Every decision is read
    from the rows at one rate, so a second sweep over them probes nothing."""
    best, tried = leader.rate, grid | {leader.chunk}
    while top is None or best * (1 + step) <= top:
        rung = best * (1 + step)
        above = judge(replace(leader, rate=rung))
        if above["holds"]:  # a rate the ladder stopped below (a ceiling of an earlier run)
            break
        larger = _binding_slo(above) == "ttft"
        side = [c for c in tried if (c > leader.chunk if larger else c < leader.chunk)]
        if side:
            bound = min(side) if larger else max(side)
            beyond = judge(replace(leader, chunk=bound, rate=rung))
            if not beyond["holds"] and _binding_slo(beyond) == _binding_slo(above):
                break
            chunk = round((leader.chunk + bound) / 2 / CHUNK_GRAIN) * CHUNK_GRAIN
        else:
            chunk = leader.chunk * 2 if larger else leader.chunk // 2
        if chunk in tried or not CHUNK_GRAIN <= chunk <= MAX_CHUNK:
            break
        tried.add(chunk)
        candidate = replace(leader, chunk=chunk, rate=best)
        climbed = _climb(candidate, [Setting(chunk, leader.batch)], best, step, top, judge)
        if climbed > best:
            leader, best = replace(candidate, rate=climbed), climbed


def _peer_layouts(by_family: dict[tuple, list[dict]], key: tuple) -> list[Figure]:
    """The highest held figure of each other family of `key`'s cell (rows by _family_key), as
    `auto` runs it: a P:D split as it is, colocated's as every worker hybrid (`auto` on the
    same GPUs and engine setting); highest first, each layout and setting once."""
    highest = [highest_held(rows) for peer, rows in by_family.items()
               if (peer[:3], peer[4]) == (key[:3], key[4]) and peer[3] != key[3]]  # fmt: skip
    layouts: dict[tuple, Figure] = {}
    for held in sorted(filter(None, highest), key=lambda row: -row["rate"]):
        figure = _figure_of(held)
        if figure.split == "colocated":
            figure = replace(figure, split="hybrid")
        layouts.setdefault((figure.split, figure.chunk, figure.batch), figure)
    return list(layouts.values())


def _refine(held: float, failed: list[Figure], precision: float, judge: Callable) -> None:
    """Where the documented figures are far apart (a burst at one chunk budget, the next figure
    a search of another SLO pair), the figure that held understates the family by up to the
    gap: on each layout and setting that failed above it (the highest first), bisects the rate
    between the best that held so far and the lowest that failed there, to `precision`."""
    lowest: dict[tuple, Figure] = {}
    for f in failed:  # highest first: the last one kept per setting is its lowest
        lowest[f.split, f.chunk, f.batch] = f
    for top in lowest.values():
        low, high = held, top.rate
        while high > low * (1 + precision):
            rate = (low * high) ** 0.5
            row = judge(replace(top, rate=rate, source=f"bisected below {top.source}"))
            low, high = (rate, high) if row["holds"] else (low, rate)
        held = low


def screen_row(figure: Figure, probe: PairedProbe) -> dict:
    row = {**asdict(figure), "layout": probe.layout}
    row.update(requests=probe.requests, good=probe.good, attainment=probe.attainment,
               holds=probe.attainment >= HOLDS, ttft_mean_ms=probe.ttft_mean_ms,
               ttft_p90_ms=probe.ttft_p90_ms, tpot_p90_ms=probe.tpot_p90_ms,
               remote_share=probe.remote_share, complete=probe.complete,
               missed=probe.missed)  # fmt: skip
    return row


def paired_rows(probes: Iterable[PairedProbe], model: str, workload: str, slo: str, split: str,
                setting: Setting, requests_per_worker: int) -> list[dict]:  # fmt: skip
    """`--at-rates` probes as screen rows: equal-rate probes of every family count among the
    figures the confirmed table judges. A family's highest held figure is the top rung of the
    rates it was offered, and near the knee a verdict turns on a few requests (8B phases,
    TTFT <= 200 ms: the conditional rule held at 70.21018 req/s with the 819 misses 8192
    requests allow and failed at 70.21 with 824), so the family offered more rates there
    reads higher; on a shared grid each is offered the same ones."""
    probes = list(probes)
    families = {p.family for p in probes}
    rows = []
    for p in probes:
        others = sorted(families - {p.family})
        figure = Figure(model, workload, slo, p.family,
                        "colocated" if p.family == "colocated" else split, setting.chunk,
                        setting.batch, p.rate, f"equal rates with {', '.join(others) or '-'}",
                        requests_per_worker)  # fmt: skip
        rows.append(screen_row(figure, p))
    return rows


def attainment_text(row: dict) -> str:
    """A row's share within SLO; a probe stopped on a certain failure: its upper bound."""
    if row["holds"] or row["complete"]:
        return f"{row['attainment']:.2f}"
    bound = 1 - row["missed"] / row["requests"]  # the share not yet missed when it stopped
    return f"< {math.floor(bound * 100 + 1) / 100:.2f}"


def row_key(row: dict) -> tuple:
    return Figure(**{k: row[k] for k in Figure.__dataclass_fields__}).key


def read_rows(path: Path) -> dict[tuple, dict]:
    """The rows of a screen's JSONL file, by figure."""
    if not path.exists():
        return {}
    rows = (json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line)
    return {row_key(row): row for row in rows}
