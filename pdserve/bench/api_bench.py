"""`pdserve bench api`: what the OpenAI HTTP API costs against gRPC. Same system, same workload.

One system (1 prefill + 1 decode worker, every prompt prefilled remotely) serves the same
closed-loop load twice per round: through the gRPC API (load_generator.py) and through the
OpenAI HTTP API's streaming /v1/completions (openai_load.py); the order alternates between
rounds so drift falls on both. The report gives p50 TTFT, ITL, TPOT and E2E of both and their
ratios (http / grpc); the target is TTFT and ITL p50 within 5%. It also gives the CPU time
each API took per output token, on the client's thread, on the router's event-loop thread and
in the whole process (the client runs in the router's process): wall-clock latencies on a busy
machine vary between rounds, CPU time much less.

    pdserve bench api --num-requests 64 --max-concurrency 4 --rounds 2
"""

from __future__ import annotations

import argparse
import asyncio
import threading
import time

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


# Where CPU time is counted: the client's thread (the caller's), the router's event-loop
# thread, and the whole process (with gRPC's and Ray's own threads).
CPU_PARTS = ("client", "router", "process")


def cpu_now(router_clock: int) -> tuple[float, ...]:
    """CPU seconds used so far by each of CPU_PARTS; `router_clock` is the router thread's
    CPU clock id."""
    return (time.thread_time(), time.clock_gettime(router_clock), time.process_time())


async def _thread_id() -> int:
    return threading.get_ident()


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
    cpu = {api: [0.0] * len(CPU_PARTS) for api in APIS}
    load = {"max_concurrency": args.max_concurrency, "seed": args.seed}
    with serve_pair(model_dir) as app:
        target, base_url = f"127.0.0.1:{app.port}", f"http://127.0.0.1:{app.http_port}/v1"
        router_clock = time.pthread_getcpuclockid(app.run(_thread_id()))

        def drive(api: str, batch: list) -> list:
            if api == "grpc":
                return asyncio.run(run_load(target, batch, **load))
            return asyncio.run(run_openai_load(base_url, model_dir.name, batch, **load))

        for api in APIS:  # warm-up: connections, caches of both paths
            drive(api, requests[:2])
        for round_ in range(args.rounds):
            for api in APIS if round_ % 2 == 0 else reversed(APIS):
                before = cpu_now(router_clock)
                got = drive(api, requests)
                spent = zip(cpu[api], cpu_now(router_clock), before, strict=True)
                cpu[api] = [total + now - then for total, now, then in spent]
                records[api] += got
                seconds[api] += run_duration(got)
                s = summarize(got, run_duration(got))
                console.print(
                    f"round {round_ + 1} {api}: {s.completed} done, {s.failed} failed; p50 "
                    f"TTFT {s.ttft.p50:.1f} ms, ITL {s.itl.p50:.2f} ms, E2E {s.e2e.p50:.1f} ms"
                )
    summaries = {api: summarize(records[api], seconds[api]) for api in APIS}
    console.print(_table(summaries, cpu, args))
    grpc, http = summaries["grpc"], summaries["http"]
    within = all(
        abs(b / a - 1) <= TOLERANCE
        for a, b in ((grpc.ttft.p50, http.ttft.p50), (grpc.itl.p50, http.itl.p50))
        if a
    )
    console.print(f"p50 TTFT and ITL within {TOLERANCE:.0%}: {'yes' if within else 'no'}")
    return finish_paired(summaries, args.json)


def _table(summaries: dict, cpu: dict[str, list[float]], args: argparse.Namespace):
    grpc, http = summaries["grpc"], summaries["http"]
    per_token = {  # CPU µs per output token
        api: (1e6 / summaries[api].total_output_tokens if summaries[api].total_output_tokens else 0)
        for api in APIS
    }
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
        *(
            (
                f"{part} CPU µs/token",
                cpu["grpc"][i] * per_token["grpc"],
                cpu["http"][i] * per_token["http"],
            )
            for i, part in enumerate(CPU_PARTS)
        ),
    ]
    return ratio_table(title, APIS, rows)
