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

`--together` serves both APIs at once instead, each with half the requests in flight, on
one event loop of the client process, so every round's conditions (the machine's load, the
workers' batches: a decode step makes the next token of both APIs' requests) fall on both
alike and the ratios measure the API paths alone; CPU time per API cannot be told apart then.

    pdserve bench api --num-requests 64 --max-concurrency 4 --rounds 2
"""

from __future__ import annotations

import argparse
import asyncio
import math
import multiprocessing
import os
import sys
import threading
import time
from concurrent.futures import ProcessPoolExecutor

from pdserve.bench.common.local_system import (
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
    from pdserve.bench.common.load_generator import run_load
    from pdserve.bench.serving.openai_load import run_openai_load

    before = time.process_time()
    if api == "grpc":
        records = asyncio.run(run_load(address, batch, **load))
    else:
        records = asyncio.run(run_openai_load(address, model, batch, **load))
    return records, time.process_time() - before


def run_clients_together(
    addresses: dict[str, str], model: str, batches: dict[str, list], loads: dict[str, dict]
) -> dict[str, list]:
    """In the client process: both APIs' loads at once on one event loop, each over its own
    batch with its own load settings; each API's records."""
    from pdserve.bench.common.load_generator import run_load
    from pdserve.bench.serving.openai_load import run_openai_load

    async def both() -> list[list]:
        return await asyncio.gather(
            run_load(addresses["grpc"], batches["grpc"], **loads["grpc"]),
            run_openai_load(addresses["http"], model, batches["http"], **loads["http"]),
        )

    return dict(zip(APIS, asyncio.run(both()), strict=True))


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
    p.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="requests/s per API, Poisson arrivals (default: inf, a closed loop at "
        "--max-concurrency)",
    )
    p.add_argument(
        "--together",
        action="store_true",
        help="serve both APIs at once, each with half of --max-concurrency and its half of "
        "--num-requests (halves swapped every round), so both meet the same conditions; "
        "no CPU time per API. Closed loops at once fall into step (both APIs' streams end in "
        "the same decode step and their next requests race for the prefill worker); with "
        "--request-rate each API's arrivals come from a seed of its own",
    )


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from pdserve.workloads.metrics import summarize

    model_dir, requests = paired_workload(args)
    if args.together and (args.max_concurrency < 2 or args.num_requests < 2):
        raise SystemExit("--together needs --max-concurrency and --num-requests >= 2")
    console = Console()
    start_ray(prefill_workers=1, decode_workers=1)
    experiments = "" if args.grpc_event_engine_client else GRPC_CLIENT_EXPERIMENTS
    with serve_pair(model_dir) as app, client_process(experiments) as clients:
        addresses = {
            "grpc": f"127.0.0.1:{app.port}",
            "http": f"http://127.0.0.1:{app.http_port}/v1",
        }
        rounds = _Rounds(args, clients, addresses, model_dir.name, console)
        for api in APIS:  # warm-up: the client process, connections, caches of both paths
            rounds.drive(api, requests[:2])
        if args.together:
            rounds.together(requests)
        else:
            rounds.one_after_the_other(requests, time.pthread_getcpuclockid(app.run(_thread_id())))
    summaries = {api: summarize(rounds.records[api], rounds.seconds[api]) for api in APIS}
    console.print(_table(summaries, rounds.cpu, args))
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


class _Rounds:
    """The rounds of one run: each API's records, seconds of load and CPU seconds by part."""

    def __init__(self, args, clients, addresses: dict[str, str], model: str, console) -> None:
        self.args, self.clients, self.addresses, self.model = args, clients, addresses, model
        self.console = console
        self.load = {
            "max_concurrency": args.max_concurrency,
            "seed": args.seed,
            "request_rate": args.request_rate,
        }
        self.records: dict[str, list] = {api: [] for api in APIS}
        self.seconds = dict.fromkeys(APIS, 0.0)
        self.cpu = {api: [0.0] * len(CPU_PARTS) for api in APIS}

    def drive(self, api: str, batch: list) -> tuple[list, float]:
        job = self.clients.submit(
            run_client, api, self.addresses[api], self.model, batch, self.load
        )
        return job.result()

    def one_after_the_other(self, requests: list, router_clock: int) -> None:
        """Each round serves `requests` through one API, then the other (order alternating),
        counting each API's CPU time."""
        for round_ in range(self.args.rounds):
            for api in APIS if round_ % 2 == 0 else reversed(APIS):
                before = router_cpu_now(router_clock)
                got, client_s = self.drive(api, requests)
                now = (client_s, *router_cpu_now(router_clock))
                spent = zip(self.cpu[api], now, (0, *before), strict=True)
                self.cpu[api] = [total + end - start for total, end, start in spent]
                self._record(round_, api, got)

    def together(self, requests: list) -> None:
        """Each round serves both APIs at once, each half of `requests` with half the
        concurrency; the halves swap between rounds, so both APIs send every prompt equally
        often (a prompt sent again may hit the prefix cache)."""
        halves = (requests[0::2], requests[1::2])
        for round_ in range(self.args.rounds):
            swap = round_ % 2
            batches = dict(zip(APIS, halves[::-1] if swap else halves, strict=True))
            # Each API's arrival schedule from a seed of its own (the two seeds swap too).
            loads = {
                api: {
                    **self.load,
                    "max_concurrency": self.args.max_concurrency // 2,
                    "seed": self.args.seed + 2 * round_ + (i ^ swap),
                }
                for i, api in enumerate(APIS)
            }
            job = self.clients.submit(
                run_clients_together, self.addresses, self.model, batches, loads
            )
            for api, got in job.result().items():
                self._record(round_, api, got)

    def _record(self, round_: int, api: str, got: list) -> None:
        from pdserve.workloads.metrics import run_duration, summarize

        self.records[api] += got
        self.seconds[api] += run_duration(got)
        s = summarize(got, run_duration(got))
        self.console.print(
            f"round {round_ + 1} {api}: {s.completed} done, {s.failed} failed; p50 "
            f"TTFT {s.ttft.p50:.1f} ms, ITL {s.itl.p50:.2f} ms, E2E {s.e2e.p50:.1f} ms"
        )


def _table(summaries: dict, cpu: dict[str, list[float]], args: argparse.Namespace):
    grpc, http = summaries["grpc"], summaries["http"]
    per_token = {  # CPU µs per output token
        api: (1e6 / summaries[api].total_output_tokens if summaries[api].total_output_tokens else 0)
        for api in APIS
    }
    how = (
        f"both at once, concurrency {args.max_concurrency // 2} each"
        if args.together
        else f"one after the other, concurrency {args.max_concurrency}"
    )
    title = (
        f"OpenAI HTTP vs gRPC streaming: {grpc.num_requests} requests per API, "
        f"prompt {args.input_len}, output {args.output_len}, {how}"
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
    ]
    if not args.together:  # together, one process serves both APIs: no CPU time per API
        rows += [
            (
                f"{part} CPU µs/token",
                cpu["grpc"][i] * per_token["grpc"],
                cpu["http"][i] * per_token["http"],
            )
            for i, part in enumerate(CPU_PARTS)
        ]
    return ratio_table(title, APIS, rows)
