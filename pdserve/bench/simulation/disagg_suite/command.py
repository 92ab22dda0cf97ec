"""`pdserve bench sim-disagg --suite`: the suite's flags, its run and its report.

Offline, on the planner's virtual cluster (pdserve/planner: pdserve's engine, scheduler and
router policy on a virtual clock, no Ray): the live simulated cluster of `sim-disagg` runs one
Ray actor per GPU and reaches a few hundred simulated requests/s on two cores, where 8 H100s
serve thousands of chat requests/s. Probes are scaled down (`--requests-per-worker` requests per
simulated worker, goodput within `--precision`): a cell costs CPU minutes, not hours.

With --at-rates R1,R2,... there is no search: one cell's families are probed at those rates on
one split and engine setting, paired (paired.py), where goodputs lie within the bracket
(`--screen-rows` adds the probes to a screen's rows, screen.paired_rows).

With --plot DIR, each cell's families are also offered load at fixed fractions of its
goodput (curves.py) and drawn as goodput against rate, one PNG per model and workload, with a
markdown summary table of every cell in DIR (plots.py).

The report: per cell, each family's goodput (best split and engine setting), `auto` over the
best static layout (colocated or a split, whichever is better) and over colocated, the rules
against `auto`, and the targets of issue 49 checked: auto >= 0.95x the best static layout and
>= 1.0x colocated; auto's goodput >= each rule's.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from pdserve.bench.simulation.disagg_suite.suite import (
    FAMILIES,
    MODELS,
    REQUESTS_PER_WORKER,
    SLOS,
    SUITE_MODELS,
    SUITE_SLOS,
    Cell,
    FamilyBest,
    Setting,
    SuiteOptions,
    family_splits,
    run_cell,
    split_key,
)
from pdserve.bench.simulation.disagg_suite.targets import targets
from pdserve.bench.simulation.disagg_suite.workloads import NAMED_WORKLOADS, WORKLOADS

# --quick: one model, two workloads that sit on either side of the question, one SLO, two
# chunk budgets.
QUICK = {"models": "8b", "suite_workloads": "code,rag", "slos": "loose", "chunks": "512,2048",
         "batch_limits": "256"}  # fmt: skip


def add_suite_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--suite", action="store_true", help="the workload suite, offline (see docs)")
    p.add_argument("--quick", action="store_true", help="--suite: a small subset")
    p.add_argument("--models", default=",".join(SUITE_MODELS),
                   help="--suite: 8b (8 H100, TP 1), 70b (16, TP 4) (also: 70b-tp8, and per "
                   "pool 70b-p4d8: prefill TP 4, decode and colocated TP 8; 70b-p8d4)")  # fmt: skip
    p.add_argument("--suite-workloads", default=",".join(WORKLOADS),
                   help="--suite: workloads (also: long-rag)")  # fmt: skip
    p.add_argument("--slos", default=",".join(SUITE_SLOS),
                   help="--suite: loose, tight-tpot, tight-ttft (also: tighter-tpot, "
                   "tight-tpot-2s, tighter-tpot-0.95s/1.2s/1.5s/2s, tpot-17ms, tpot-16.5ms)")  # fmt: skip
    p.add_argument("--families", default=",".join(FAMILIES), help="--suite: layout families")
    p.add_argument(
        "--splits",
        default="",
        help="--suite: P:D splits searched, and hybrid (auto's every worker hybrid) (default: all)",
    )
    p.add_argument("--chunks", default="256,512,1024,2048", help="--suite: chunk budgets swept")
    p.add_argument("--batch-limits", default="128,256", help="--suite: max_num_seqs swept")
    p.add_argument("--requests-per-worker", type=int, default=REQUESTS_PER_WORKER,
                   help="--suite: probe size")  # fmt: skip
    p.add_argument("--precision", type=float, default=0.1, help="--suite: goodput bracket")
    p.add_argument("--jobs", type=int, default=1, help="--suite: processes per search")
    p.add_argument("--push-fixed-ms", type=float, default=0.0,
                   help="--suite: what a KV push costs besides its bytes over the link "
                   "(0: the analytical profiles' default)")  # fmt: skip
    p.add_argument(
        "--at-rates",
        default="",
        help="--suite: no search; each family's SLO attainment at these cluster rates on one "
        "cell, split and setting (paired.py)",
    )
    p.add_argument(
        "--screen",
        default="",
        help="--suite: no search; the figures of these suite --json files (or folders of them), "
        "also under looser SLOs, per cell and family from the highest down, each on its steady "
        "probe until one holds; "
        "rows appended to --json (JSONL, resumed) (screen.py)",
    )
    p.add_argument("--screen-depth", type=int, default=8,
                   help="--screen: figures probed per cell and family before giving up")  # fmt: skip
    p.add_argument("--screen-refine", type=float, default=0.0,
                   help="--screen: bisect the gap above each family's held figure on the "
                   "failed figure's layout and setting to this precision (0: off)")  # fmt: skip
    p.add_argument("--screen-settings", type=float, default=0.0,
                   help="--screen: then each family's highest held figure's layout at its own "
                   "and every --chunks x --batch-limits setting, from the best rate held up in "
                   "steps of this fraction while it holds; auto also on the layout (colocated's: "
                   "hybrid workers) and setting of each other family's highest held figure, "
                   "and at that figure's rate; then each family's chunk bisected between and "
                   "past the grid's toward the SLO its best breaks (0: off)")  # fmt: skip
    p.add_argument("--screen-rows",
                   help="--at-rates: also append each probe to this screen JSONL "
                   "(coverage/screen.jsonl), so the confirmed table judges the equal-rate "
                   "probes with the rest")  # fmt: skip
    p.add_argument("--plot-confirmed", action="store_true",
                   help="--suite --plot DIR: no search; each family's curve at its confirmed "
                   "figure (DIR/coverage/screen.jsonl), at --requests-per-worker's sample")  # fmt: skip
    p.add_argument("--summary", default="",
                   help="--suite: no run; rewrite the summary table in DIR from its files (plots.py)")  # fmt: skip


@dataclass(frozen=True)
class Selection:
    """The cells and families a --suite command was given (--models, --suite-workloads, --slos,
    --families)."""

    models: list[str]
    workloads: list[str]
    slos: list[str]
    families: list[str]

    def cells(self) -> Iterator[tuple[str, str, str]]:
        """(model, workload, SLO pair), in the suite's order."""
        return itertools.product(self.models, self.workloads, self.slos)

    def holds(self, model: str, workload: str, slo: str, family: str) -> bool:
        return (model in self.models and workload in self.workloads and slo in self.slos
                and family in self.families)  # fmt: skip


def _names(value: str, known, flag: str) -> list[str]:
    names = [n.strip() for n in value.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise ValueError(f"{flag}: {unknown or value!r} not among {', '.join(known)}")
    return names


def _split_names(value: str, models: list[str]) -> tuple[str, ...]:
    """--splits as "P:D" names, each a split of every model's workers."""
    names = tuple(n.strip() for n in value.split(",") if n.strip())
    for name in names:
        if name == "hybrid":  # every worker hybrid (`auto` only)
            continue
        p, _, d = name.partition(":")
        if not (p.isdigit() and d.isdigit() and int(p) > 0 and int(d) > 0):
            raise ValueError(f"--splits: {name!r} is not P:D (e.g. 1:7)")
        for model in models:
            known = [split_key(s) for s in family_splits(MODELS[model], "split")]
            if name not in known:
                raise ValueError(f"--splits: {name} is not a split of {model} "
                                 f"({', '.join(known)})")  # fmt: skip
    return names


def run_suite(args: argparse.Namespace) -> int:
    if args.summary:
        from pdserve.bench.simulation.disagg_suite.plots import SUMMARY, summary_markdown

        folder = Path(args.summary)
        (folder / SUMMARY).write_text(summary_markdown(folder), encoding="utf-8")
        print(f"sim-disagg --suite --summary: {folder / SUMMARY}")
        return 0
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    try:
        selection = Selection(
            _names(args.models, MODELS, "--models"),
            _names(args.suite_workloads, NAMED_WORKLOADS, "--suite-workloads"),
            _names(args.slos, SLOS, "--slos"),
            _names(args.families, FAMILIES, "--families"),
        )
        settings = tuple(
            Setting(int(c), int(b))
            for c in args.chunks.split(",")
            for b in args.batch_limits.split(",")
        )
        splits = _split_names(args.splits, selection.models)
        if args.push_fixed_ms < 0:
            raise ValueError(f"--push-fixed-ms: {args.push_fixed_ms:g} is negative")
        if args.push_fixed_ms and (args.screen or args.plot_confirmed):
            # their figures were measured with free pushes: re-probing them at another cost
            # would judge one run's figures on another's cluster
            raise ValueError("--push-fixed-ms: not with --screen or --plot-confirmed")
    except ValueError as e:
        print(f"sim-disagg --suite: {e}")
        return 2
    options = SuiteOptions(
        settings, args.requests_per_worker, args.precision, tuple(selection.families), args.jobs,
        args.seed,
        splits=splits, push_fixed_ms=args.push_fixed_ms,
    )  # fmt: skip
    if args.at_rates:
        return _run_paired(args, selection, splits, options)
    if args.screen:
        return _run_screen(args, selection, options)
    if args.plot_confirmed:
        return _plot_confirmed(args, selection, options)
    started = time.perf_counter()
    print(
        f"suite (offline virtual cluster): {len(list(selection.cells()))} cells, "
        f"families {', '.join(selection.families)}, settings chunk x batch "
        f"{', '.join(f'{s.chunk}x{s.batch}' for s in settings)}, "
        f"{args.requests_per_worker} requests per simulated worker, precision {args.precision:g}",
        flush=True,
    )
    cells: list[Cell] = []
    for model, workload, slo in selection.cells():
        cell = run_cell(model, workload, slo, options, _print_family)
        cells.append(cell)
        print(cell_summary(cell), flush=True)
        if args.plot:
            _plot(Path(args.plot), cell, options)
        if args.json:
            _write_json(Path(args.json), cells)
    print(summary_table(cells))
    print(f"suite: {time.perf_counter() - started:.0f} s")
    return 0


def _run_paired(
    args: argparse.Namespace, selection: Selection, splits: tuple[str, ...], options: SuiteOptions
) -> int:
    from pdserve.bench.simulation.disagg_suite import screen
    from pdserve.bench.simulation.disagg_suite.paired import paired_attainment, paired_table

    try:
        rates = [float(r) for r in args.at_rates.split(",") if r.strip()]
    except ValueError:
        rates = []
    single = {"--models": selection.models, "--suite-workloads": selection.workloads,
              "--slos": selection.slos,
              "--splits": splits, "--chunks x --batch-limits": options.settings}  # fmt: skip
    many = [flag for flag, values in single.items() if len(values) != 1]
    if many or not rates or min(rates) <= 0:
        print(f"sim-disagg --suite --at-rates: positive rates, and one value of each of "
              f"{', '.join(single)} (got several or none: {', '.join(many) or '-'})")  # fmt: skip
        return 2
    started = time.perf_counter()
    [(model, workload, slo)] = selection.cells()  # one of each, checked above
    try:
        probes = paired_attainment(model, workload, slo, selection.families, splits[0],
                                   options.settings[0], rates, options)  # fmt: skip
    except ValueError as e:  # a family without that layout (hybrid: `auto` only)
        print(f"sim-disagg --suite --at-rates: {e}")
        return 2
    for p in probes:
        print(f"  {p.family:<11} {p.layout} at {p.rate:g} req/s: {p.good}/{p.requests} within "
              f"SLO ({p.attainment:.4f}); TTFT mean {p.ttft_mean_ms:.0f} ms, p90 "
              f"{p.ttft_p90_ms:.0f} ms, TPOT p90 "
              f"{p.tpot_p90_ms:.2f} ms, {p.remote_share:.1%} prefilled remotely")  # fmt: skip
    print(paired_table(probes))
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        rows = [{**asdict(p), "attainment": p.attainment} for p in probes]
        path.write_text(json.dumps(rows, indent=2) + "\n", encoding="utf-8")
    if args.screen_rows:
        rows = screen.paired_rows(probes, model, workload, slo, splits[0], options.settings[0],
                                  options.requests_per_worker)  # fmt: skip
        with Path(args.screen_rows).open("a", encoding="utf-8") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
    print(f"suite --at-rates: {time.perf_counter() - started:.0f} s")
    return 0


def _run_screen(args: argparse.Namespace, selection: Selection, options: SuiteOptions) -> int:
    from pdserve.bench.simulation.disagg_suite import screen

    if not args.json or args.screen_depth < 1:
        print("sim-disagg --suite --screen: needs --json (the screen's JSONL) and a positive "
              "--screen-depth")  # fmt: skip
        return 2
    started = time.perf_counter()
    out = Path(args.json)
    done = screen.read_rows(out)
    figures = [
        replace(f, requests_per_worker=args.requests_per_worker)
        for f in screen.with_looser_slos(
            screen.documented_figures(screen.suite_files(args.screen.split(",")))
        )
        if selection.holds(f.model, f.workload, f.slo, f.family)
    ]
    print(f"screen: {len(figures)} documented figures, {len(done)} judged in {out} already",
          flush=True)  # fmt: skip
    out.parent.mkdir(parents=True, exist_ok=True)

    def keep(row: dict) -> None:
        with out.open("a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
        verdict = "holds" if row["holds"] else "fails"
        print(f"  {row['model']} {row['workload']} {row['slo']} {row['family']:<11} "
              f"{row['layout']}, chunk {row['chunk']} batch {row['batch']} at "
              f"{row['rate']:.2f} req/s: {screen.attainment_text(row)} within SLO, {verdict} "
              f"(TTFT p90 {row['ttft_p90_ms']:.0f} ms, TPOT p90 {row['tpot_p90_ms']:.1f} ms)",
              flush=True)  # fmt: skip

    rows = screen.screen(figures, done, args.screen_depth, on_row=keep,
                         refine=args.screen_refine)  # fmt: skip
    if args.screen_settings > 0:
        judged = {**done, **{screen.row_key(row): row for row in rows}}
        rows += screen.sweep_settings(rows, options.settings, args.screen_settings, judged,
                                      on_row=keep)  # fmt: skip
    held = sum(row["holds"] for row in rows)
    print(f"screen: {len(rows)} figures judged, {held} hold; "
          f"{time.perf_counter() - started:.0f} s")  # fmt: skip
    return 0


def _plot_confirmed(args: argparse.Namespace, selection: Selection, options: SuiteOptions) -> int:
    """Curves of the cells a screen confirmed, each family on the layout and setting of its
    highest held figure: no search, so a cell costs its curves' probes alone."""
    from pdserve.bench.simulation.disagg_suite.confirmed import SCREEN, confirmed_cell
    from pdserve.bench.simulation.disagg_suite.coverage import COVERAGE_DIR
    from pdserve.bench.simulation.disagg_suite.screen import read_rows

    if not args.plot:
        print("sim-disagg --suite --plot-confirmed: needs --plot DIR")
        return 2
    out_dir = Path(args.plot)
    rows = list(read_rows(out_dir / COVERAGE_DIR / SCREEN).values())
    for model, workload, slo in selection.cells():
        cell = confirmed_cell(rows, model, workload, slo, args.requests_per_worker)
        cell.families = {f: b for f, b in cell.families.items() if f in selection.families}
        if not cell.families:
            print(f"  {model} {workload} {slo}: no family confirmed at "
                  f"{args.requests_per_worker} requests per worker; skipped")  # fmt: skip
            continue
        for best in cell.families.values():
            _print_family(cell, best)
        _plot(out_dir, cell, options)
    return 0


def _plot(out_dir: Path, cell: Cell, options: SuiteOptions) -> None:
    from pdserve.bench.simulation.disagg_suite.curves import cell_curves
    from pdserve.bench.simulation.disagg_suite.plots import SUMMARY, known_goodputs, write_cell

    started = time.perf_counter()
    curves = cell_curves(cell, options, known_goodputs(out_dir, cell))
    png = write_cell(out_dir, cell, curves)
    print(
        f"  -> goodput vs rate: {png}, table of every plotted cell: {out_dir / SUMMARY} "
        f"({time.perf_counter() - started:.0f} s)",
        flush=True,
    )


def _print_family(cell: Cell, best: FamilyBest) -> None:
    setting = best.setting
    where = f"{best.split}, chunk {setting.chunk}, batch {setting.batch}" if setting else "-"
    print(
        f"  {cell.model} {cell.workload} {cell.slo}: {best.family:<11} {best.goodput:9.2f} "
        f"req/s ({where}; mean TTFT {best.ttft_mean_ms:.0f} ms, TPOT p90 "
        f"{best.tpot_p90_ms:.1f} ms, {best.remote_share:.1%} prefilled remotely)",
        flush=True,
    )


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else float("inf") if a > 0 else 1.0


def cell_summary(cell: Cell) -> str:
    colocated = cell.goodput("colocated")
    parts = [f"{f} {_ratio(cell.goodput(f), colocated):.2f}x" for f in cell.families]
    checks = targets(cell)
    failed = [name for name, ok in checks.items() if not ok]
    verdict = "all met" if not failed else "missed: " + ", ".join(failed)
    line = f"  -> vs best colocated: {', '.join(parts)}; targets {verdict}"
    if cell.ceiling is not None:
        line += f"; compute ceiling {cell.ceiling:.1f} req/s"
    if cell.above_ceiling():
        line += f" (above it, a burst: {', '.join(cell.above_ceiling())})"
    return line


def summary_table(cells: list[Cell]) -> str:
    families = [f for f in FAMILIES if any(f in c.families for c in cells)]
    header = f"{'model':<5} {'workload':<8} {'slo':<10} " + " ".join(f"{f:>12}" for f in families)
    lines = ["goodput req/s (x best colocated)", header + "  auto/best static  targets"]
    for c in cells:
        colocated = c.goodput("colocated")
        row = " ".join(
            f"{c.goodput(f):>6.1f} {_ratio(c.goodput(f), colocated):>4.2f}x" for f in families
        )
        checks = targets(c)
        met = sum(checks.values())
        auto_static = _ratio(c.goodput("auto"), c.best_static)
        lines.append(
            f"{c.model:<5} {c.workload:<8} {c.slo:<10} {row}  {auto_static:>16.2f}  "
            f"{met}/{len(checks)}"
        )
    return "\n".join(lines)


def _write_json(path: Path, cells: list[Cell]) -> None:
    document = [
        {**asdict(c), "targets": targets(c), "best_static": c.best_static,
         "above_ceiling": c.above_ceiling()}
        for c in cells
    ]  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
