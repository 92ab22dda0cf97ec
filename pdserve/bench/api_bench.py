"""`pdserve bench api`: what the OpenAI HTTP API costs against gRPC. Same system, same workload.

One system (1 prefill + 1 decode worker, every prompt prefilled remotely) serves the same
closed-loop load twice per round: through the gRPC API (load_generator.py) and through the
OpenAI HTTP API's streaming /v1/completions (openai_load.py); the order alternates between
rounds so drift falls on both. The report gives p50 TTFT, ITL, TPOT and E2E of both and their
ratios (http / grpc); the target is TTFT and ITL p50 within 5%.

    pdserve bench api --num-requests 64 --max-concurrency 4 --rounds 2
"""

from __future__ import annotations

import argparse
import asyncio

from pdserve.bench.local_system import (
    add_paired_arguments,
    finish_paired,
    paired_workload,
    ratio_table,
    serve_pair,
    start_ray,
)

APIS = ("grpc", "http")
TOLERANCE = 0.05  # the target: p50 TTFT and ITL over HTTP within 5% of gRPC's


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_paired_arguments(p, "API", rounds=2, rounds_help="grpc/http pairs, order alternating")


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from pdserve.bench.load_generator import run_load
    from pdserve.bench.metrics import run_duration, summarize
    from pdserve.bench.openai_load import run_openai_load

    model_dir, requests = paired_workload(args)
    console = Console()
    start_ray(prefill_workers=1, decode_workers=1)
    records: dict[str, list] = {api: [] for api in APIS}
    seconds = dict.fromkeys(APIS, 0.0)
    load = {"max_concurrency": args.max_concurrency, "seed": args.seed}
    with serve_pair(model_dir) as app:
        target, base_url = f"127.0.0.1:{app.port}", f"http://127.0.0.1:{app.http_port}/v1"

        def drive(api: str, batch: list) -> list:
            if api == "grpc":
                return asyncio.run(run_load(target, batch, **load))
            return asyncio.run(run_openai_load(base_url, model_dir.name, batch, **load))

        for api in APIS:  # warm-up: connections, caches of both paths
            drive(api, requests[:2])
        for round_ in range(args.rounds):
            for api in APIS if round_ % 2 == 0 else reversed(APIS):
                got = drive(api, requests)
                records[api] += got
                seconds[api] += run_duration(got)
                s = summarize(got, run_duration(got))
                console.print(
                    f"round {round_ + 1} {api}: {s.completed} done, {s.failed} failed; p50 "
                    f"TTFT {s.ttft.p50:.1f} ms, ITL {s.itl.p50:.2f} ms, E2E {s.e2e.p50:.1f} ms"
                )
    summaries = {api: summarize(records[api], seconds[api]) for api in APIS}
    console.print(_table(summaries, args))
    grpc, http = summaries["grpc"], summaries["http"]
    within = all(
        abs(b / a - 1) <= TOLERANCE
        for a, b in ((grpc.ttft.p50, http.ttft.p50), (grpc.itl.p50, http.itl.p50))
        if a
    )
    console.print(f"p50 TTFT and ITL within {TOLERANCE:.0%}: {'yes' if within else 'no'}")
    return finish_paired(summaries, args.json)


def _table(summaries: dict, args: argparse.Namespace):
    grpc, http = summaries["grpc"], summaries["http"]
    title = (
        f"OpenAI HTTP vs gRPC streaming: {grpc.num_requests} requests per API, "
        f"prompt {args.input_len}, output {args.output_len}, concurrency {args.max_concurrency}"
    )
    rows = [
        ("p50 TTFT ms", grpc.ttft.p50, http.ttft.p50),
        ("p50 ITL ms", grpc.itl.p50, http.itl.p50),
        ("p50 TPOT ms", grpc.tpot.p50, http.tpot.p50),
        ("p50 E2E ms", grpc.e2e.p50, http.e2e.p50),
        ("p99 TTFT ms", grpc.ttft.p99, http.ttft.p99),
        ("output tok/s", grpc.output_throughput, http.output_throughput),
    ]
    return ratio_table(title, APIS, rows)
