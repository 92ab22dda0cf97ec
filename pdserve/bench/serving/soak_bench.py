"""`pdserve bench soak`: does anything grow under sustained load? Not a CI test: run for minutes.

Starts a system on this machine and sends the mixed workload (long prompts + short chats) as
an open-loop stream at `--rate` requests/s for `--minutes`; a `--cancel-fraction` of requests
is cancelled by the client after a few tokens. Meanwhile the resident memory (RSS) of every
process is sampled: the router (this process), each worker actor, Redis. The report gives each
process's RSS over time and its max/min ratio (flat = within 10%), the cancels issued, errors
by gRPC status, and what the workers still hold once the load has settled (open KV transfers,
used blocks: both must be 0). Exit status 1 when something is left behind.

    pdserve bench soak --minutes 30 --rate 4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pdserve.bench.common.local_system import (
    add_mixed_arguments,
    add_model_arguments,
    load_model,
    mixed_requests,
    serve_locally,
    start_ray,
)

FLAT_RATIO = 1.10  # max/min RSS over the run that still counts as flat


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p, preset="tiny")
    p.add_argument("--minutes", type=float, default=10.0, help="how long to send load")
    p.add_argument("--rate", type=float, default=4.0, help="requests per second (Poisson)")
    p.add_argument("--cancel-fraction", type=float, default=0.2, help="requests cancelled early")
    p.add_argument("--prefill-workers", type=int, default=1)
    p.add_argument("--decode-workers", type=int, default=1)
    p.add_argument("--transport", default="grpc", choices=["grpc", "collective"])
    p.add_argument(
        "--sample-interval-s", type=float, help="RSS sampling period (default: 1/20 of the run)"
    )
    p.add_argument("--seed", type=int, default=0)
    add_mixed_arguments(
        p, long_fraction=0.2, long_input=512, long_output=8, short_input=32, short_output=32
    )
    p.add_argument("--json", help="write the report to this file")


@dataclass
class ProcessMemory:
    """RSS samples of one process: (seconds since the start, MiB)."""

    name: str
    pids: list[int] = field(default_factory=list)  # more than one if it restarted
    samples: list[tuple[float, float]] = field(default_factory=list)

    @property
    def ratio(self) -> float:
        values = [mib for _, mib in self.samples]
        return max(values) / min(values) if values and min(values) > 0 else float("nan")

    @property
    def flat(self) -> bool:
        return self.ratio <= FLAT_RATIO


@dataclass
class SoakReport:
    minutes: float
    rate: float
    sent: int = 0
    completed: int = 0
    cancels: int = 0
    errors: dict[str, int] = field(default_factory=dict)  # gRPC status name -> count
    memory: list[ProcessMemory] = field(default_factory=list)
    open_transfers: int = 0  # at the end, once the load settled
    used_blocks: int = 0
    leftovers: dict[str, dict] = field(default_factory=dict)

    @property
    def clean(self) -> bool:
        return self.open_transfers == 0 and self.used_blocks == 0

    def to_dict(self) -> dict:
        document = asdict(self)
        for entry, memory in zip(document["memory"], self.memory, strict=True):
            entry["max_over_min"] = memory.ratio
            entry["flat"] = memory.flat
        document["clean"] = self.clean
        return document


def run(args: argparse.Namespace) -> int:
    import ray
    from rich.console import Console

    if args.minutes <= 0 or args.rate <= 0 or not 0 <= args.cancel_fraction <= 1:
        raise SystemExit("--minutes and --rate must be > 0, --cancel-fraction in [0, 1]")
    model_dir, model_config = load_model(args)
    duration_s = args.minutes * 60.0
    interval_s = args.sample_interval_s or max(duration_s / 20.0, 0.5)
    # Enough requests for the whole run at the given rate, and then some.
    requests = mixed_requests(args, model_config, int(duration_s * args.rate * 1.5) + 8, args.seed)
    console = Console()
    if not ray.is_initialized():
        start_ray(args.prefill_workers, args.decode_workers)
    report = SoakReport(minutes=args.minutes, rate=args.rate)
    console.print("[bold]soak[/bold]: starting the system")
    with _serve(model_dir, args) as served:
        target = f"127.0.0.1:{served.port}"
        asyncio.run(_warm_up(target, requests[:4]))
        sampler = _MemorySampler(served.app, interval_s)
        sampler.start()
        try:
            asyncio.run(_load(target, requests, args, duration_s, report))
        finally:
            sampler.stop()
        report.memory = sampler.memory
        _settle(served.app, report)
    console.print(_table(report))
    console.print(_summary(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report.to_dict(), indent=2))
    return 0 if report.clean else 1


def _serve(model_dir: Path, args: argparse.Namespace):
    app = serve_locally(
        model_dir,
        prefill_workers=args.prefill_workers,
        decode_workers=args.decode_workers,
        router={"disaggregate": "always" if args.prefill_workers else "never"},
    )
    app.app.config.kv.transport = args.transport
    return app


async def _warm_up(target: str, requests) -> None:
    from pdserve.client import AsyncGenerationClient

    async with AsyncGenerationClient(target) as client:
        for request in requests:
            await client.generate(request.prompt, max_tokens=request.output_len, ignore_eos=True)


async def _load(target, requests, args, duration_s: float, report: SoakReport) -> None:
    """Open-loop arrivals for `duration_s`; each request runs to its end or is cancelled."""
    from pdserve.bench.common.load_generator import arrival_times
    from pdserve.client import AsyncGenerationClient

    offsets = arrival_times(len(requests), args.rate, seed=args.seed)
    rng = random.Random(args.seed)
    errors: Counter[str] = Counter()
    async with AsyncGenerationClient(target) as client:
        start = time.perf_counter()
        tasks = []
        for request, offset in zip(requests, offsets, strict=True):
            if offset >= duration_s:
                break
            await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
            # Cancel after this many tokens (None = let it finish).
            cancel_after = (
                rng.randint(1, max(1, request.output_len - 1))
                if rng.random() < args.cancel_fraction
                else None
            )
            tasks.append(asyncio.create_task(_one(client, request, cancel_after, report, errors)))
            report.sent += 1
        await asyncio.gather(*tasks)
    report.errors = dict(errors)


async def _one(client, request, cancel_after: int | None, report: SoakReport, errors) -> None:
    """One request: counted as completed, cancelled (by us) or an error (by status)."""
    from pdserve.client import GenerationError
    from pdserve.pb import generate_pb2

    stream = client.generate_stream(request.prompt, max_tokens=request.output_len, ignore_eos=True)
    tokens, finish = 0, generate_pb2.FINISH_REASON_UNSPECIFIED
    try:
        async for response in stream:
            tokens += len(response.token_ids)
            finish = response.finish_reason
            if cancel_after is not None and tokens >= cancel_after and not finish:
                report.cancels += 1
                return
    except GenerationError as error:
        errors[error.code.name] += 1
        return
    finally:
        await stream.aclose()  # cancels the RPC when it is still running
    if finish in (generate_pb2.FINISH_REASON_STOP, generate_pb2.FINISH_REASON_LENGTH):
        report.completed += 1
    else:  # the server aborted it, or the stream ended without a last response
        errors["FINISH_ABORT" if finish else "INCOMPLETE"] += 1


class _MemorySampler:
    """Samples RSS of the router, every worker and Redis on a thread, every `interval_s`."""

    def __init__(self, app, interval_s: float) -> None:
        self._app = app
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        self._by_name: dict[str, ProcessMemory] = {}
        self._start = time.perf_counter()

    @property
    def memory(self) -> list[ProcessMemory]:
        return list(self._by_name.values())

    def start(self) -> None:
        self._start = time.perf_counter()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()  # the last point, as the load ends

    def _run(self) -> None:
        while True:
            self.sample()
            if self._stop.wait(self._interval_s):
                return

    def sample(self) -> None:
        import psutil

        from pdserve.bench.common.system_probe import redis_pid, worker_pids

        # A restarting worker answers no pid now: it is sampled next time.
        pids = {"router": os.getpid(), **worker_pids(self._app)}
        redis = redis_pid(self._app)
        if redis is not None:
            pids["redis"] = redis
        now = time.perf_counter() - self._start
        for name, pid in pids.items():
            try:
                rss = psutil.Process(pid).memory_info().rss / 2**20
            except psutil.Error:
                continue
            memory = self._by_name.setdefault(name, ProcessMemory(name))
            if pid not in memory.pids:
                memory.pids.append(pid)
            memory.samples.append((round(now, 2), round(rss, 2)))


def _settle(app, report: SoakReport) -> None:
    from pdserve.bench.common.system_probe import settled_leftovers

    leftovers = settled_leftovers(app)
    report.leftovers = {worker: asdict(left) for worker, left in leftovers.items()}
    report.open_transfers = sum(left.open_transfers for left in leftovers.values())
    report.used_blocks = sum(left.used_blocks for left in leftovers.values())


def _table(report: SoakReport):
    from rich.table import Table

    columns = 5  # RSS shown at this many evenly spaced sample times (fits 80 columns)
    table = Table(title=f"Soak: RSS per process (MiB), {report.minutes} min at {report.rate} req/s")
    table.add_column("process", no_wrap=True)
    longest = max((m.samples for m in report.memory), key=len, default=[])
    picks = _spread(len(longest), columns)
    for i in picks:
        table.add_column(f"t={longest[i][0]:.0f}s", justify="right", min_width=6)
    table.add_column("max/min", justify="right", no_wrap=True)
    table.add_column("flat", justify="center", min_width=4)
    for memory in report.memory:
        cells = [f"{memory.samples[i][1]:.1f}" if i < len(memory.samples) else "-" for i in picks]
        restarted = f" x{len(memory.pids)}" if len(memory.pids) > 1 else ""  # processes over time
        table.add_row(
            memory.name + restarted, *cells, f"{memory.ratio:.3f}", "yes" if memory.flat else "NO"
        )
    return table


def _spread(n: int, k: int) -> list[int]:
    """Up to `k` indices of a list of `n`, evenly spread, first and last included."""
    if n <= k:
        return list(range(n))
    return sorted({round(i * (n - 1) / (k - 1)) for i in range(k)})


def _summary(report: SoakReport) -> str:
    errors = ", ".join(f"{k} {v}" for k, v in sorted(report.errors.items())) or "none"
    return (
        f"requests sent {report.sent}, completed {report.completed}, "
        f"cancels issued {report.cancels}\n"
        f"errors by status: {errors}\n"
        f"at the end: open transfers {report.open_transfers}, "
        f"used blocks {report.used_blocks} ({'clean' if report.clean else 'LEFT BEHIND'})"
    )
