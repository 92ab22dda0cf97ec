"""Drives the Generation API with a workload and records client-side timestamps.

Open loop: request i is released at `arrival_times(...)[i]` seconds after the start, whatever
the server's progress; gaps are gamma-distributed with mean 1/rate and shape `burstiness`
(vLLM's benchmark: burstiness 1 is a Poisson process, < 1 burstier, > 1 more regular).
Closed loop: `max_concurrency` caps requests in flight; with an infinite rate every request
is released at once and waits for a slot, so exactly that many are always in flight. Both
can be combined. A released request's send time is taken when it actually starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import secrets
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import TYPE_CHECKING

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from pdserve.workloads.datasets import BenchRequest
from pdserve.workloads.metrics import RequestRecord

if TYPE_CHECKING:  # `drive` alone serves `bench fidelity-worker` where no gRPC stack is installed
    from pdserve.client import AsyncGenerationClient, GenerateParams


def arrival_times(
    num_requests: int, request_rate: float, burstiness: float = 1.0, seed: int = 0
) -> list[float]:
    """Release offsets in seconds: 0 for the first request, then cumulative gamma gaps.

    The gaps have mean 1/request_rate and coefficient of variation 1/sqrt(burstiness).
    `request_rate` = inf releases everything at 0. The same arguments give the same schedule.
    """
    if request_rate <= 0 or burstiness <= 0:
        raise ValueError("request_rate and burstiness must be > 0")
    if num_requests <= 0:
        return []
    if math.isinf(request_rate):
        return [0.0] * num_requests
    # Own stream, independent of the dataset's draws from the same seed.
    rng = np.random.default_rng([seed, 1])
    gaps = rng.gamma(
        shape=burstiness, scale=1.0 / (request_rate * burstiness), size=num_requests - 1
    )
    return [0.0, *np.cumsum(gaps).tolist()]


async def run_load(
    target: str,
    requests: Sequence[BenchRequest],
    *,
    request_rate: float = math.inf,
    burstiness: float = 1.0,
    max_concurrency: int | None = None,
    seed: int = 0,
    progress: bool = False,
    api_key: str | None = None,
    timeout: float | None = None,
    params: GenerateParams | None = None,
) -> list[RequestRecord]:
    """Sends every request (prompt, max_tokens=output_len, ignore_eos) and records each one.

    Returns one record per request, in workload order; failures are records with `ok=False`
    and the gRPC status name in `error_code`, never dropped. `params` adds sampling settings
    (default greedy). The run's duration is `metrics.run_duration(records)`.
    """
    from pdserve.client import AsyncGenerationClient

    async with AsyncGenerationClient(target, api_key=api_key, timeout=timeout) as client:

        async def send(request: BenchRequest, record: RequestRecord, slots, on_done) -> None:
            await _send(client, request, record, slots, dict(params or {}), on_done)

        return await drive(
            requests,
            send,
            request_rate=request_rate,
            burstiness=burstiness,
            max_concurrency=max_concurrency,
            seed=seed,
            progress=progress,
        )


# (request, its record, the concurrency slots or None, the progress callback): sends one.
Sender = Callable[
    [BenchRequest, RequestRecord, "asyncio.Semaphore | None", Callable[[RequestRecord], None]],
    Awaitable[None],
]


async def drive(
    requests: Sequence[BenchRequest],
    send: Sender,
    *,
    request_rate: float = math.inf,
    burstiness: float = 1.0,
    max_concurrency: int | None = None,
    seed: int = 0,
    progress: bool = False,
) -> list[RequestRecord]:
    """Releases each request at its arrival time through `send` (any API's client), at most
    `max_concurrency` in flight; returns the records in workload order."""
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError("max_concurrency must be >= 1")
    offsets = arrival_times(len(requests), request_rate, burstiness, seed)
    run_id = secrets.token_hex(4)  # request ids stay unique across runs against one server
    records = [
        RequestRecord(i, f"bench-{run_id}-{i}", r.prompt_len, r.output_len, r.tag)
        for i, r in enumerate(requests)
    ]
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    with _progress_bar(len(requests), enabled=progress) as on_done:
        start = time.perf_counter()
        tasks = []
        for request, record, offset in zip(requests, records, offsets, strict=True):
            delay = start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(send(request, record, slots, on_done)))
        await asyncio.gather(*tasks)
    return records


async def _send(
    client: AsyncGenerationClient,
    request: BenchRequest,
    record: RequestRecord,
    slots: asyncio.Semaphore | None,
    params: dict,
    on_done: Callable[[RequestRecord], None],
) -> None:
    async with slots or contextlib.nullcontext():
        from pdserve.client import Completion, GenerationError

        completion = Completion()
        record.send_time = time.perf_counter()
        try:
            fixed = {"max_tokens": request.output_len, "ignore_eos": True}
            params = params | fixed | {"request_id": record.request_id}
            stream = client.generate_stream(request.prompt, **params)
            async for response in stream:
                now = time.perf_counter()  # first, so parsing time is not counted as latency
                if response.token_ids:
                    record.chunk_times.append(now)
                    record.chunk_tokens.append(len(response.token_ids))
                completion.add(response)
        except GenerationError as error:
            record.error_code, record.error = error.code.name, error.details
        except Exception as error:  # a client-side bug must show up as a failure, not vanish
            record.error_code, record.error = type(error).__name__, str(error)
        record.end_time = time.perf_counter()
        record.finish_reason = completion.finish_reason
        record.cached_prompt_tokens = completion.usage.cached_prompt_tokens
        record.server_timings = dataclasses.asdict(completion.timings)
        if record.error_code is None:
            if completion.finish_reason in ("stop", "length"):
                record.ok = True
            elif completion.finish_reason == "abort":
                record.error_code, record.error = "FINISH_ABORT", "aborted by the server"
            else:
                record.error_code, record.error = "INCOMPLETE", "stream ended without finishing"
        on_done(record)


@contextlib.contextmanager
def _progress_bar(total: int, *, enabled: bool) -> Iterator[Callable[[RequestRecord], None]]:
    """Yields the per-request callback; draws a bar on stderr when enabled."""
    if not enabled:
        yield lambda record: None
        return
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn())
    failed = 0
    with Progress(*columns, TimeElapsedColumn(), console=Console(stderr=True)) as bar:
        task = bar.add_task("requests", total=total)

        def on_done(record: RequestRecord) -> None:
            nonlocal failed
            failed += not record.ok
            label = f"requests ([red]{failed} failed[/])" if failed else "requests"
            bar.update(task, advance=1, description=label)

        yield on_done
