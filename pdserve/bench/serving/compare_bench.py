"""`pdserve bench compare`: does disaggregation pay off here? Same machine, same workload.

Two layouts of the same two cores, each worker pinned to its own core:
  disaggregated: 1 prefill worker + 1 decode worker (every prompt is prefilled remotely);
  colocated:     2 workers that both prefill and decode (every prompt is prefilled locally).
Both serve the mixed workload (long prompts + short chats) at each request rate; the report
gives goodput, p99 TTFT and p99 TPOT of both and their ratios (disaggregated / colocated).
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

from pdserve.bench.common.local_system import (
    add_mixed_arguments,
    add_model_arguments,
    load_model,
    mixed_requests,
    serve_locally,
    start_ray,
)

LAYOUTS = {
    # name: (prefill workers, decode workers, disaggregate)
    "disaggregated": (1, 1, "always"),
    "colocated": (0, 2, "never"),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p, preset="small")
    p.add_argument("--rates", default="0.5,1,2", help="request rates (req/s), comma separated")
    p.add_argument("--num-requests", type=int, default=40, help="requests per rate")
    p.add_argument("--seed", type=int, default=0)
    add_mixed_arguments(
        p, long_fraction=0.2, long_input=1024, long_output=16, short_input=64, short_output=64
    )
    p.add_argument("--slo-ttft-ms", type=float, default=3000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=100.0)
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=512,
        help="token budget per engine step (the prefill chunk size)",
    )
    p.add_argument("--json", help="write all summaries to this file")
    p.add_argument("--plot", help="write latency CDFs per rate into this directory")


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from pdserve.workloads.metrics import run_duration, summarize

    model_dir, model_config = load_model(args)
    requests = mixed_requests(args, model_config, args.num_requests, args.seed)
    rates = [float(r) for r in args.rates.split(",")]
    console = Console()
    start_ray(max(p for p, _, _ in LAYOUTS.values()), max(d for _, d, _ in LAYOUTS.values()))
    results: dict[str, dict[float, object]] = {}
    records_by_rate: dict[float, dict[str, list]] = {rate: {} for rate in rates}
    for layout in LAYOUTS:
        console.print(f"[bold]{layout}[/bold]: starting the system")
        with _serve(layout, model_dir, args) as app:
            target = f"127.0.0.1:{app.port}"
            asyncio.run(_warm_up(target, requests))
            results[layout] = {}
            for rate in rates:
                from pdserve.bench.common.load_generator import run_load

                records = asyncio.run(
                    run_load(target, requests, request_rate=rate, seed=args.seed, progress=True)
                )
                summary = summarize(
                    records, run_duration(records), args.slo_ttft_ms, args.slo_tpot_ms
                )
                results[layout][rate] = summary
                records_by_rate[rate][layout] = records
                console.print(
                    f"  rate {rate:g}/s: goodput {summary.goodput:.3f} req/s, "
                    f"p99 TTFT {summary.ttft.p99:.0f} ms, "
                    f"p99 TPOT {summary.tpot.p99:.1f} ms, "
                    f"failed {summary.failed}"
                )
    console.print(_table(results, rates, args))
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    layout: {str(rate): s.to_dict() for rate, s in by_rate.items()}
                    for layout, by_rate in results.items()
                },
                indent=2,
            )
        )
    if args.plot:
        from pdserve.bench.common.plots import plot_cdfs

        for rate, by_layout in records_by_rate.items():
            plot_cdfs(
                by_layout,
                Path(args.plot) / f"rate-{rate:g}",
                slo_ms={"ttft": args.slo_ttft_ms, "tpot": args.slo_tpot_ms},
            )
    return 0


def _table(results, rates, args):
    from rich.table import Table

    table = Table(
        title=f"Disaggregated vs colocated, mixed workload "
        f"(SLO: TTFT {args.slo_ttft_ms:g} ms, TPOT {args.slo_tpot_ms:g} ms)"
    )
    for column in (
        "rate req/s",
        "goodput D",
        "goodput C",
        "D/C",
        "p99 TTFT D ms",
        "p99 TTFT C ms",
        "D/C",
        "p99 TPOT D ms",
        "p99 TPOT C ms",
        "D/C",
    ):
        table.add_column(column, justify="right")
    for rate in rates:
        d, c = results["disaggregated"][rate], results["colocated"][rate]
        table.add_row(
            f"{rate:g}",
            f"{d.goodput:.3f}",
            f"{c.goodput:.3f}",
            _ratio(d.goodput, c.goodput),
            f"{d.ttft.p99:.0f}",
            f"{c.ttft.p99:.0f}",
            _ratio(d.ttft.p99, c.ttft.p99),
            f"{d.tpot.p99:.1f}",
            f"{c.tpot.p99:.1f}",
            _ratio(d.tpot.p99, c.tpot.p99),
        )
    return table


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b else "-"


def _serve(layout: str, model_dir: Path, args: argparse.Namespace):
    prefill, decode, disaggregate = LAYOUTS[layout]
    return serve_locally(
        model_dir,
        prefill_workers=prefill,
        decode_workers=decode,
        engine={"max_num_batched_tokens": args.max_num_batched_tokens},
        router={
            "disaggregate": disaggregate,
            "ttft_slo_ms": args.slo_ttft_ms,
            "tpot_slo_ms": args.slo_tpot_ms,
        },
    )


async def _warm_up(target: str, requests) -> None:
    """The longest and the shortest request once each, so first-call costs (allocations at a
    new size, connections) do not land in the figures."""
    from pdserve.bench.common.load_generator import run_load

    by_length = sorted(requests, key=lambda r: r.prompt_len)
    await run_load(target, [by_length[-1], by_length[0]], max_concurrency=1)
