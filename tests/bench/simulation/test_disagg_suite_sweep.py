"""`sim-disagg --suite --screen-settings`: each family's confirmed layout swept over engine
settings, its chunk refined between and past the grid's, and `auto` on the other families'."""

from __future__ import annotations

from dataclasses import replace

from pdserve.bench.simulation.disagg_suite.paired import PairedProbe
from pdserve.bench.simulation.disagg_suite.screen import (
    Figure,
    highest_held,
    row_key,
    screen_row,
    sweep_settings,
)
from pdserve.bench.simulation.disagg_suite.suite import Setting
from tests.bench.simulation.screen_helpers import figure_at, probe_by_layout, probe_holding_up_to


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

    held = replace(figure_at("split", 100.0, "3:1"), chunk=2048)
    rows = [screen_row(held, probe_holding_up_to(100, [])(held))]
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
    probe = probe_by_layout(limits, calls)

    def held(family: str, split: str, chunk: int, rate: float, **other) -> dict:
        figure = replace(figure_at(family, rate, split), chunk=chunk, **other)
        return screen_row(figure, probe_holding_up_to(rate, [])(figure))

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
    held = replace(figure_at("auto", 90.0, "3:5"), slo="tight-tpot")
    rows = [screen_row(held, probe_holding_up_to(90, [])(held))]
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
    held = replace(figure_at("split", 100.0, "3:1"), chunk=2048)
    rows = [screen_row(held, probe_holding_up_to(100, [])(held))]
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
    probe = probe_by_layout(limits, calls, remote_share=0.0)

    def held(family: str, split: str) -> dict:
        figure = replace(figure_at(family, 100.0, split), chunk=1024)
        return screen_row(figure, probe_holding_up_to(100.0, [])(figure))

    rows = [held("auto", "hybrid"), held("colocated", "colocated")]
    judged = sweep_settings(rows, [Setting(512, 256)], 0.05, {row_key(r): r for r in rows},
                            probe=probe, ceiling=lambda model, workload: None)  # fmt: skip
    families = [f.family for f in calls]
    assert families == sorted(families, key=lambda family: family == "auto")  # `auto` last
    best = highest_held(r for r in judged if r["family"] == "auto")
    assert (best["split"], best["chunk"], round(best["rate"], 2)) == ("hybrid", 512, 115.76)
