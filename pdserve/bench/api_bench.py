"""`pdserve bench api`: what the OpenAI HTTP API costs against gRPC. Same system, same workload.

One system (1 prefill + 1 decode worker, every prompt prefilled remotely) serves the same
closed-loop load twice per round: through the gRPC API (load_generator.py) and through the
OpenAI HTTP API's streaming /v1/completions (openai_load.py); the order alternates between
rounds so drift falls on both. The report gives p50 TTFT, ITL, TPOT and E2E of both and their
ratios (http / grpc); the target is TTFT and ITL p50 within 5%. It also gives the CPU time
each API took per output token: in the client's process, on the router's event-loop thread and
in the whole router process: wall-clock latencies on a busy machine vary between rounds, CPU
time much less.

Both clients run in one child process, as real clients run outside the router. A gRPC client
inside the router's process would share its grpc.aio completion poller (one per process, whose
events wake every loop using gRPC there, the loop that takes them handing the others' on with
`call_soon_threadsafe`), and the client's poller and gRPC core threads would be counted as the
router's CPU: costs real clients never put on the router and the HTTP client never pays.
In that process gRPC core's EventEngine client is off (GRPC_CLIENT_EXPERIMENTS), which cuts
the gRPC client's CPU per token by about a fifth.

    pdserve bench api --num-requests 64 --max-concurrency 4 --rounds 2
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import sys
import threading
import time
from concurrent.futures import ProcessPoolExecutor

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


# Where CPU time is counted: the client's process (every thread of it), the router's
# event-loop thread, and the whole router process (with gRPC's and Ray's own threads).
CPU_PARTS = ("client", "router", "process")


def router_cpu_now(router_clock: int) -> tuple[float, float]:
    """CPU seconds used so far by the router's thread (`router_clock` is its CPU clock id)
    and by this, the router's, process."""
    return time.clock_gettime(router_clock), time.process_time()


# gRPC core's EventEngine client (the default since grpcio 1.6x) reads a channel's socket on
# a pool of its own threads, which hand each message to grpc.aio's completion poller thread,
# which wakes the event loop: two thread hand-offs per streamed message. With it off, the
# poller thread reads the socket itself. Measured on a stub server streaming 4 x 32-token
# streams: the client's CPU per message 116-143 -> 92-104 µs (the pool's threads took 30-55),
# p90 delivery latency 0.7-1.8 -> 0.4-0.5 ms (BENCHMARKS.md, issue 15). gRPC reads
# GRPC_EXPERIMENTS once, when grpc is first imported; a grpcio without that experiment logs
# "Unknown experiment" once and runs as shipped.
GRPC_CLIENT_EXPERIMENTS = "-event_engine_client"


def _configure_client_process(grpc_experiments: str) -> None:
    """The client process's initializer: gRPC core's experiments, before grpc is imported."""
    if "grpc" in sys.modules:
        raise RuntimeError("grpc was imported before the gRPC client's settings were made")
    given = os.environ.get("GRPC_EXPERIMENTS")
    if grpc_experiments:
        os.environ["GRPC_EXPERIMENTS"] = ",".join(filter(None, (given, grpc_experiments)))


def client_process(grpc_experiments: str = GRPC_CLIENT_EXPERIMENTS) -> ProcessPoolExecutor:
    """The one process the benchmark's clients run in (spawned: no Ray, no router state);
    `grpc_experiments` "" leaves gRPC core as grpcio ships it."""
    return ProcessPoolExecutor(
        max_workers=1,
        mp_context=multiprocessing.get_context("spawn"),
        initializer=_configure_client_process,
        initargs=(grpc_experiments,),
    )


def run_client(api: str, address: str, model: str, batch: list, load: dict) -> tuple[list, float]:
    """In the client process: one closed-loop run of `batch` through `api` at `address` (a
    gRPC target, or the HTTP API's base URL); its records and the CPU seconds the process
    spent on it."""
    from pdserve.bench.load_generator import run_load
    from pdserve.bench.openai_load import run_openai_load

    before = time.process_time()
    if api == "grpc":
        records = asyncio.run(run_load(address, batch, **load))
    else:
        records = asyncio.run(run_openai_load(address, model, batch, **load))
    return records, time.process_time() - before


async def _thread_id() -> int:
    return threading.get_ident()


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_paired_arguments(p, "API", rounds=2, rounds_help="grpc/http pairs, order alternating")
    p.add_argument(
        "--grpc-event-engine-client",
        action="store_true",
        help="leave gRPC core's EventEngine client on in the client process, as grpcio ships "
        "it (the benchmark's gRPC client before issue 15's fix), to compare",
    )


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from pdserve.bench.metrics import run_duration, summarize

    model_dir, requests = paired_workload(args)
    console = Console()
    start_ray(prefill_workers=1, decode_workers=1)
    records: dict[str, list] = {api: [] for api in APIS}
    seconds = dict.fromkeys(APIS, 0.0)
    cpu = {api: [0.0] * len(CPU_PARTS) for api in APIS}
    load = {"max_concurrency": args.max_concurrency, "seed": args.seed}
    experiments = "" if args.grpc_event_engine_client else GRPC_CLIENT_EXPERIMENTS
    with serve_pair(model_dir) as app, client_process(experiments) as clients:
        address = {
            "grpc": f"127.0.0.1:{app.port}",
            "http": f"http://127.0.0.1:{app.http_port}/v1",
        }
        router_clock = time.pthread_getcpuclockid(app.run(_thread_id()))

        def drive(api: str, batch: list) -> tuple[list, float]:
            job = clients.submit(run_client, api, address[api], model_dir.name, batch, load)
            return job.result()

        for api in APIS:  # warm-up: the client process, connections, caches of both paths
            drive(api, requests[:2])
        for round_ in range(args.rounds):
            for api in APIS if round_ % 2 == 0 else reversed(APIS):
                before = router_cpu_now(router_clock)
                got, client_s = drive(api, requests)
                spent = zip(
                    cpu[api], (client_s, *router_cpu_now(router_clock)), (0, *before), strict=True
                )
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
    # ITL two ways: per chunk (vLLM's `bench serve`) depends on how many tokens each message
    # carries, which the two APIs' write paths can differ on; per token (SGLang's
    # `bench_serving`) splits a chunk's gap over its tokens.
    checks = {
        "TTFT": (grpc.ttft.p50, http.ttft.p50),
        "ITL per chunk": (grpc.itl.p50, http.itl.p50),
        "ITL per token": (grpc.token_itl.p50, http.token_itl.p50),
    }
    verdicts = [
        f"{name} {'yes' if a and abs(b / a - 1) <= TOLERANCE else 'no'}"
        for name, (a, b) in checks.items()
    ]
    console.print(f"p50 within {TOLERANCE:.0%} (HTTP vs gRPC): " + ", ".join(verdicts))
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
        ("p50 ITL ms (per chunk)", grpc.itl.p50, http.itl.p50),
        ("p50 ITL ms (per token)", grpc.token_itl.p50, http.token_itl.p50),
        (
            "tokens per chunk after the first",
            grpc.token_itl.count / max(grpc.itl.count, 1),
            http.token_itl.count / max(http.itl.count, 1),
        ),
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
