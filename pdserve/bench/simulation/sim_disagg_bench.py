"""`pdserve bench sim-disagg`: disaggregated vs colocated serving on simulated GPUs (issue 14 5a).

    pdserve bench sim-disagg --plot out/sim-disagg

Eight (`--workers`) sim workers on the analytical H100 profile with Llama-3.1-8B's shape in bfloat16, each
with the KV pool an 80 GB H100 holds after the 16 GB of weights, serve two workloads:
  chat-rag  ShareGPT-like chat (log-normal lengths) among long summarization/RAG prompts
            (2k-6k tokens, short answers): where prefill interferes with decoding;
  short     chat with short prompts only: where it hardly does.
Layouts: `colocated` (8 workers that prefill and decode, `disaggregate=never`), every split
`P:D` with P + D = 8 (`disaggregate=always`), and `auto P:D` (the router's conditional
disaggregation on that split: each request prefilled remotely or on its decode worker, by cost).
Each layout is started once per workload and offered every rate of `--rates` in turn (simulated
requests/s for the whole cluster, a Poisson stream, new prompts
for each rate: `--duration` simulated seconds of arrivals, at least `--min-requests`).

SLO attainment at a rate: the fraction of its requests (failed ones count as misses) with
TTFT <= --slo-ttft-ms and TPOT <= --slo-tpot-ms (simulated time; TPOT = (E2E - TTFT) / (output
tokens - 1), a one-token request meets any TPOT). Goodput (DistServe): the rate at which
attainment falls below --attainment (0.9), interpolated linearly between the swept rates
(`metrics.goodput_rate`); a layout that never falls below gets the highest rate swept, marked
">=". Every run passes the saturation check (`sim_saturation.SaturationCheck`) or the bench stops with
its refusal. The report: attainment per rate and goodput per layout, the best split's goodput over
colocated's, and for the auto layouts the fraction of requests they prefilled locally.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pdserve.bench.simulation.disagg_suite.command import add_suite_arguments, run_suite
from pdserve.bench.simulation.sim_run import (
    SimCluster,
    add_cluster_arguments,
    cluster_from_args,
    local_prefill_fraction,
    run_sim_load,
    serve_sim,
    wait_idle,
)
from pdserve.bench.simulation.sim_saturation import Saturated, checked_run

NUM_WORKERS = 8
WORKLOADS = ("chat-rag", "short")


@dataclass
class RatePoint:
    """One layout at one rate, in simulated time."""

    rate: float
    attainment: float
    completed: int
    failed: int
    ttft_p50_ms: float
    ttft_p90_ms: float
    tpot_p50_ms: float
    tpot_p90_ms: float
    local_prefills: float  # fraction of completed requests prefilled on their decode worker


@dataclass
class LayoutResult:
    layout: str
    prefill_workers: int
    decode_workers: int
    disaggregate: str
    points: list[RatePoint] = field(default_factory=list)
    goodput: float = 0.0
    goodput_is_lower_bound: bool = False
    saturation: list[dict] = field(default_factory=list)  # SaturationCheck.summary() per rate


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_cluster_arguments(p, time_scale=20.0)
    p.add_argument("--workers", type=int, default=NUM_WORKERS, help="GPUs of every layout")
    p.add_argument(
        "--rates", default="10,20,30,40,60", help="simulated requests/s of the whole cluster"
    )
    p.add_argument(
        "--duration",
        type=float,
        default=3.0,
        help="simulated seconds of arrivals per rate (requests: rate x duration)",
    )
    p.add_argument("--min-requests", type=int, default=24, help="requests per rate at least")
    p.add_argument(
        "--layouts",
        default="colocated,"
        + ",".join(f"{p}:{NUM_WORKERS - p}" for p in range(1, NUM_WORKERS))
        + ",auto 2:6",
        help="comma separated: colocated, P:D (always remote), auto P:D (by cost)",
    )
    p.add_argument("--workloads", default=",".join(WORKLOADS), help="chat-rag, short")
    p.add_argument("--slo-ttft-ms", type=float, default=400.0)
    p.add_argument("--slo-tpot-ms", type=float, default=40.0)
    p.add_argument("--attainment", type=float, default=0.9, help="goodput's SLO attainment")
    p.add_argument("--rag-fraction", type=float, default=0.3, help="chat-rag: long prompts")
    p.add_argument("--short-input-median", type=int, default=64, help="short: prompt median")
    p.add_argument("--chat-max-output-len", type=int, default=512, help="longest chat answer")
    p.add_argument("--rag-output-len", type=int, default=100)
    p.add_argument(
        "--warmup-requests", type=int, default=16, help="before the sweep, at its highest rate"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write every result to this file")
    p.add_argument("--plot", help="write attainment curves and latency CDFs into this directory")
    add_suite_arguments(p)


def parse_layout(name: str, workers: int = NUM_WORKERS) -> tuple[int, int, str]:
    """(prefill workers, decode workers, disaggregate) of a layout name; ValueError if bad."""
    name = name.strip()
    if name == "colocated":
        return 0, workers, "never"
    mode, _, split = name.rpartition(" ")
    if mode not in ("", "auto"):
        raise ValueError(f"layout {name!r}: expected colocated, P:D or auto P:D")
    try:
        prefill, decode = (int(n) for n in split.split(":"))
    except ValueError:
        raise ValueError(f"layout {name!r}: expected colocated, P:D or auto P:D") from None
    if prefill < 1 or decode < 1 or prefill + decode != workers:
        raise ValueError(f"layout {name!r}: needs P, D >= 1 and P + D = {workers} workers")
    return prefill, decode, mode or "always"


def workload_dataset(name: str, args: argparse.Namespace):
    from pdserve.workloads.datasets import DatasetConfig

    lengths = {
        "chat_max_output_len": args.chat_max_output_len,
        "rag_output_len": args.rag_output_len,
    }
    if name == "chat-rag":
        return DatasetConfig(name="chat-rag", rag_fraction=args.rag_fraction, **lengths)
    if name == "short":
        return DatasetConfig(
            name="chat-rag",
            rag_fraction=0.0,
            chat_input_median=args.short_input_median,
            **lengths,
        )
    raise ValueError(f"unknown workload {name!r} (known: {', '.join(WORKLOADS)})")


def run(args: argparse.Namespace) -> int:
    if args.suite:
        return run_suite(args)
    from rich.console import Console

    from pdserve.bench.simulation.sim_run import bench_error, config_only_model, ensure_ray

    try:
        rates = sorted(float(r) for r in args.rates.split(","))
        layouts = [parse_layout(n, args.workers) + (n.strip(),) for n in args.layouts.split(",")]
        workloads = [w.strip() for w in args.workloads.split(",")]
        for w in workloads:
            workload_dataset(w, args)
    except ValueError as e:
        return bench_error(str(e), 2)
    model_dir = Path(args.model) if args.model else config_only_model()
    model_config = json.loads((model_dir / "config.json").read_text())
    console = Console(width=160)
    ensure_ray(max(p for p, _, _, _ in layouts), max(d for _, d, _, _ in layouts))
    results: dict[str, list[LayoutResult]] = {}
    for workload in workloads:
        results[workload] = []
        for prefill, decode, mode, name in layouts:
            cluster = cluster_from_args(
                args,
                prefill_workers=prefill,
                decode_workers=decode,
                disaggregate=mode,
                ttft_slo_ms=args.slo_ttft_ms,
                tpot_slo_ms=args.slo_tpot_ms,
            )
            console.print(f"[bold]{workload} / {name}[/bold]")
            try:
                result = measure_layout(
                    model_dir, model_config, cluster, name, workload, rates, args, console
                )
            except Saturated as refused:
                return bench_error(str(refused), 3)
            results[workload].append(result)
    for workload in workloads:
        console.print(report_table(workload, results[workload], rates, args))
        console.print(summary_line(workload, results[workload]))
        if args.plot:
            from pdserve.bench.common.plots import plot_attainment

            curves = {r.layout: {p.rate: p.attainment for p in r.points} for r in results[workload]}
            plot_attainment(curves, Path(args.plot) / f"{workload}-attainment.png", args.attainment)
    if args.json:
        document = {w: [asdict(r) for r in by] for w, by in results.items()}
        Path(args.json).write_text(json.dumps(document, indent=2) + "\n")
    return 0


def measure_layout(
    model_dir: Path,
    model_config: dict,
    cluster: SimCluster,
    name: str,
    workload: str,
    rates: list[float],
    args: argparse.Namespace,
    console,
) -> LayoutResult:
    """One layout started once, every rate in turn; raises Saturated naming the run."""
    from pdserve.workloads.metrics import goodput_rate, run_duration, slo_attainment, summarize

    result = LayoutResult(
        name, cluster.prefill_workers, cluster.decode_workers, cluster.disaggregate
    )
    with serve_sim(model_dir, cluster, model_config) as app:
        scale = cluster.time_scale
        if args.warmup_requests:
            warm = _requests(workload, args, model_config, args.warmup_requests, args.seed + 1000)
            run_sim_load(app, warm, rates[-1], scale, seed=args.seed)
            wait_idle(app)
        for i, rate in enumerate(rates):

            def attempt_at(attempt: int, rate: float = rate, seed: int = args.seed + i):
                count = max(args.min_requests, round(rate * args.duration))
                seed += 100 * attempt  # a retry's prompts are new to every prefix cache
                requests = _requests(workload, args, model_config, count, seed)
                return run_sim_load(app, requests, rate, scale, seed=seed)

            label = f"{workload} / {name} at rate {rate:g}"
            records, check = checked_run(app, args, attempt_at, label)
            summary = summarize(records, run_duration(records))
            point = RatePoint(
                rate=rate,
                attainment=slo_attainment(records, args.slo_ttft_ms, args.slo_tpot_ms),
                completed=summary.completed,
                failed=summary.failed,
                ttft_p50_ms=summary.ttft.p50,
                ttft_p90_ms=summary.ttft.p90,
                tpot_p50_ms=summary.tpot.p50,
                tpot_p90_ms=summary.tpot.p90,
                local_prefills=local_prefill_fraction(records),
            )
            result.points.append(point)
            result.saturation.append(check.summary())
            console.print(
                f"  rate {rate:g}/s: attainment {point.attainment:.0%}, TTFT p90 "
                f"{point.ttft_p90_ms:.0f} ms, TPOT p90 {point.tpot_p90_ms:.1f} ms, failed "
                f"{point.failed}, local prefills {point.local_prefills:.0%}, router busy "
                f"{check.router_busy:.0%}, worst step excess "
                f"{max([w.excess for w in check.workers] + [0.0]):+.1%}"
            )
            if args.plot:
                from pdserve.bench.common.plots import plot_cdfs

                plot_cdfs(
                    records,
                    Path(args.plot) / workload / _file_name(name) / f"rate-{rate:g}",
                    slo_ms={"ttft": args.slo_ttft_ms, "tpot": args.slo_tpot_ms},
                )
    attainment = {p.rate: p.attainment for p in result.points}
    result.goodput = goodput_rate(attainment, args.attainment)
    result.goodput_is_lower_bound = min(attainment.values()) >= args.attainment
    return result


def _file_name(layout: str) -> str:
    return layout.replace(" ", "-").replace(":", "_")


def _requests(workload: str, args, model_config: dict, count: int, seed: int):
    from pdserve.bench.common.local_system import eos_ids
    from pdserve.workloads.datasets import generate_requests

    dataset = workload_dataset(workload, args)
    return generate_requests(
        dataset, count, seed, model_config["vocab_size"], eos_ids(model_config)
    )


def report_table(workload: str, results: list[LayoutResult], rates: list[float], args):
    from rich.table import Table

    table = Table(
        title=f"{workload}: SLO attainment (TTFT <= {args.slo_ttft_ms:g} ms and TPOT <= "
        f"{args.slo_tpot_ms:g} ms, simulated) by rate, goodput at {args.attainment:.0%}"
    )
    for column in ("layout", *(f"{r:g}/s" for r in rates), "goodput req/s", "vs colocated",
                   "local prefills"):  # fmt: skip
        table.add_column(column, justify="right")
    colocated = next((r.goodput for r in results if r.layout == "colocated"), 0.0)
    for r in results:
        by_rate = {p.rate: p for p in r.points}
        table.add_row(
            r.layout,
            *(f"{by_rate[rate].attainment:.0%}" if rate in by_rate else "-" for rate in rates),
            f"{'>=' if r.goodput_is_lower_bound else ''}{r.goodput:.1f}",
            f"{r.goodput / colocated:.2f}x" if colocated else "-",
            f"{sum(p.local_prefills for p in r.points) / max(1, len(r.points)):.0%}",
        )
    return table


def summary_line(workload: str, results: list[LayoutResult]) -> str:
    """The best fixed split against colocated, and what auto did."""
    colocated = next((r for r in results if r.layout == "colocated"), None)
    splits = [r for r in results if r.disaggregate == "always"]
    parts = []
    if colocated and splits:
        best = max(splits, key=lambda r: r.goodput)
        ratio = best.goodput / colocated.goodput if colocated.goodput else float("inf")
        parts.append(
            f"best split {best.layout}: goodput {best.goodput:.1f} req/s = {ratio:.2f}x "
            f"colocated ({colocated.goodput:.1f})"
        )
    for r in results:
        if r.disaggregate == "auto":
            local = sum(p.local_prefills for p in r.points) / max(1, len(r.points))
            parts.append(
                f"{r.layout}: goodput {r.goodput:.1f} req/s, {local:.0%} prefilled locally"
            )
    return f"{workload}: " + "; ".join(parts)
