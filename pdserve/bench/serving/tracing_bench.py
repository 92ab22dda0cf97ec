"""`pdserve bench tracing`: what one trace per request costs. Same machine, same workload.

The system (1 prefill + 1 decode worker, every prompt prefilled remotely) is started twice in
one run: tracing off (no OTEL_* variables: spans are created but not sampled, so nothing is
recorded or exported), then on (every request sampled and exported over OTLP/gRPC, with the
SDK's default batching, to a receiver in this process that plays the collector). Both serve the
same closed-loop load; the report gives p50 TTFT, TPOT and E2E of both and their ratios
(on / off). `--rounds 2` repeats off/on to show the run-to-run noise.

    pdserve bench tracing --num-requests 64 --max-concurrency 4
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import time
from collections.abc import Iterator

from pdserve.bench.common.local_system import (
    add_paired_arguments,
    finish_paired,
    paired_workload,
    ratio_table,
    serve_pair,
    start_ray,
)

MODES = ("off", "on")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_paired_arguments(p, "mode", rounds=1, rounds_help="off/on pairs to run")


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from pdserve.bench.common.load_generator import run_load
    from pdserve.workloads.metrics import run_duration, summarize

    model_dir, requests = paired_workload(args)
    console = Console()
    start_ray(prefill_workers=1, decode_workers=1)
    records: dict[str, list] = {mode: [] for mode in MODES}
    seconds = dict.fromkeys(MODES, 0.0)  # summed run durations (the restarts do not count)
    spans = 0
    for round_ in range(args.rounds):
        for mode in MODES:
            console.print(f"[bold]round {round_ + 1}, tracing {mode}[/bold]: starting the system")
            with _tracing(mode) as receiver, serve_pair(model_dir) as app:
                target = f"127.0.0.1:{app.port}"
                asyncio.run(run_load(target, requests[:2], max_concurrency=1))  # warm-up
                got = asyncio.run(
                    run_load(target, requests, max_concurrency=args.max_concurrency, seed=args.seed)
                )
                records[mode] += got
                seconds[mode] += run_duration(got)
                if receiver is not None:
                    spans += _drain(receiver)
            s = summarize(got, run_duration(got))
            console.print(
                f"  {s.completed} done, {s.failed} failed; p50 TTFT {s.ttft.p50:.1f} ms, "
                f"TPOT {s.tpot.p50:.2f} ms, E2E {s.e2e.p50:.1f} ms"
            )
    summaries = {mode: summarize(records[mode], seconds[mode]) for mode in MODES}
    console.print(_table(summaries, args))
    per_request = spans / (args.rounds * (args.num_requests + 2))
    console.print(f"spans exported with tracing on: {spans} ({per_request:.1f} per request)")
    return finish_paired(summaries, args.json)


@contextlib.contextmanager
def _tracing(mode: str) -> Iterator[object | None]:
    """The OTEL_* environment of one mode, for the router (this process) and the workers (it
    is forwarded to them); with "on", the in-process receiver the exporters send to."""
    from pdserve import telemetry
    from pdserve.bench.serving.span_receiver import SpanReceiver

    saved = {k: v for k, v in os.environ.items() if k.startswith("OTEL_")}
    for key in saved:
        del os.environ[key]
    receiver = None
    if mode == "on":
        receiver = SpanReceiver(keep=False)
        endpoint = receiver.start()
        os.environ.update(
            OTEL_TRACES_EXPORTER="otlp",
            OTEL_EXPORTER_OTLP_ENDPOINT=f"http://{endpoint}",
            OTEL_EXPORTER_OTLP_PROTOCOL="grpc",
        )
    try:
        yield receiver
    finally:
        for key in [k for k in os.environ if k.startswith("OTEL_")]:
            del os.environ[key]
        os.environ.update(saved)
        telemetry.setup_tracing("pdserve-router")  # back to what the restored env asks for
        if receiver is not None:
            receiver.stop()


def _drain(receiver) -> int:
    """Waits for the batched exports of every process (router: flushed now; workers: their
    next scheduled export, 5 s by default) and returns the spans received."""
    from pdserve import telemetry

    telemetry.flush_tracing()
    time.sleep(6.0)
    return receiver.count


def _table(summaries: dict, args: argparse.Namespace):
    off, on = summaries["off"], summaries["on"]
    title = (
        f"Tracing on vs off: {off.num_requests} requests per mode, "
        f"prompt {args.input_len}, output {args.output_len}, concurrency {args.max_concurrency}"
    )
    rows = [
        ("p50 TTFT ms", off.ttft.p50, on.ttft.p50),
        ("p50 TPOT ms", off.tpot.p50, on.tpot.p50),
        ("p50 E2E ms", off.e2e.p50, on.e2e.p50),
        ("p99 TTFT ms", off.ttft.p99, on.ttft.p99),
        ("p99 E2E ms", off.e2e.p99, on.e2e.p99),
        ("output tok/s", off.output_throughput, on.output_throughput),
    ]
    return ratio_table(title, MODES, rows)
