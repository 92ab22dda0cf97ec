"""Times the router's routing decision for `bench control-plane` against a filled index.

The decision is `router.routing.Routing.choose`, the call RequestFlow makes per attempt: the
prompt's block hashes, the Redis lookup (one script call), the router's recent routes and the
policy over every worker's load. Worker load comes from synthetic handles that the real
`WorkerPool` polls (`ready`, `stats`): the decode batch, queues and free KV blocks of a busy
cluster, redrawn at every poll. Nothing else of a worker is called.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pdserve.bench.control_plane.control_plane_workload import IndexPlan, Probe
from pdserve.core.block_hash import prompt_block_hashes
from pdserve.core.messages import WorkerStats
from pdserve.prefix_index.lookup import PrefixIndex


class SyntheticWorker:
    """The part of a WorkerHandle the pool polls, answering a busy worker's load."""

    def __init__(self, stats: Callable[[], WorkerStats]) -> None:
        self._stats = stats

    async def ready(self) -> dict:
        return {}

    async def stats(self) -> WorkerStats:
        return self._stats()


@dataclass(frozen=True)
class LoadSettings:
    kv_blocks: int = 27_000  # an H100's KV pool for the 8B shape after its weights (2 MiB blocks)
    bytes_per_block: int = 2 << 20
    max_batch: int = 64


def load_drawer(plan: IndexPlan, worker: int, role: str, load: LoadSettings, seed: int) -> Callable:
    """A function drawing `worker`'s stats as a busy cluster would show them."""
    rng = random.Random(f"load:{seed}:{worker}")

    def draw() -> WorkerStats:
        free = rng.randint(load.kv_blocks // 5, load.kv_blocks * 4 // 5)
        waiting = rng.randint(0, 3)
        return WorkerStats(
            worker_id=plan.worker_id(worker),
            role=role,
            epoch=worker + 1,
            num_waiting=waiting,
            num_running=rng.randint(load.max_batch // 4, load.max_batch) if role == "decode" else 0,
            waiting_prompt_tokens=waiting * rng.randint(0, plan.settings.prompt_tokens),
            num_blocks=load.kv_blocks,
            num_free_blocks=free,
            num_used_blocks=load.kv_blocks - free,
            block_size=plan.settings.block_size,
            bytes_per_block=load.bytes_per_block,
        )

    return draw


def worker_pool(plan: IndexPlan, load: LoadSettings, seed: int = 0, colocated: bool = False):
    """The router's pool of the plan's workers; `colocated`: every worker decodes and prefills
    its own requests (no prefill pool)."""
    from router.worker_pool import WorkerPool

    handles: dict[str, dict[str, SyntheticWorker]] = {"prefill": {}, "decode": {}}
    for w in range(plan.settings.workers):
        role = "decode" if colocated else plan.role(w)
        worker = SyntheticWorker(load_drawer(plan, w, role, load, seed))
        handles[role][plan.worker_id(w)] = worker
    return WorkerPool(handles["prefill"], handles["decode"])


@dataclass
class DecisionTimes:
    """Seconds per decision and per part; counts of outcomes."""

    total: list[float] = field(default_factory=list)
    # The router thread's CPU seconds per decision: the decision's own cost, without the time
    # this process waited for a core or for Redis (a shared machine inflates wall time).
    cpu: list[float] = field(default_factory=list)
    hashing: list[float] = field(default_factory=list)
    lookup: list[float] = field(default_factory=list)
    redis_cpu_per_lookup_s: float = 0.0  # redis-server's CPU seconds per lookup (INFO cpu)
    rejected: int = 0  # admission control refused (at capacity): still a decision
    lookup_mismatches: int = 0  # lookups whose answer differs from the plan
    longest_holder_chosen: int = 0  # prompts routed to a worker holding their longest prefix
    with_holder: int = 0  # prompts some worker holds a prefix of
    wall_s: float = 0.0


async def time_decisions(routing, probes: list[Probe], max_tokens: int,
                         poll_every: int) -> DecisionTimes:  # fmt: skip
    """Routes every probe in turn (one decision at a time, by `Routing.choose_async` as the
    router's request flow does); the pool is re-polled every `poll_every` decisions, as its
    pollers would."""
    from router.types import NoWorkerAvailable, Overloaded

    out = DecisionTimes()
    start = time.perf_counter()
    for i, probe in enumerate(probes):
        if i % poll_every == 0:
            await routing.pool.poll_once()
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            route = await routing.choose_async(probe.prompt, max_tokens, set())
        except (Overloaded, NoWorkerAvailable):
            out.rejected += 1
            route = None
        out.cpu.append(time.thread_time() - c0)
        out.total.append(time.perf_counter() - t0)
        if probe.expected:
            out.with_holder += 1
            best = max(probe.expected.values())
            chosen = route and (route.prefill_worker or route.decode_worker)
            out.longest_holder_chosen += probe.expected.get(chosen, 0) == best
    out.wall_s = time.perf_counter() - start
    return out


def time_lookups(
    index: PrefixIndex, probes: list[Probe], block_size: int, out: DecisionTimes
) -> None:
    """The decision's first two parts alone, on the same prompts; checks each answer."""
    busy = _redis_cpu(index)
    for probe in probes:
        t0 = time.perf_counter()
        hashes = prompt_block_hashes(probe.prompt, block_size)
        t1 = time.perf_counter()
        found = index.lookup(hashes)
        out.lookup.append(time.perf_counter() - t1)
        out.hashing.append(t1 - t0)
        out.lookup_mismatches += found != probe.expected
    out.redis_cpu_per_lookup_s = (_redis_cpu(index) - busy) / max(1, len(probes))


def _redis_cpu(index: PrefixIndex) -> float:
    info = index.link.client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


async def concurrent_decisions(routing, probes: list[Probe], max_tokens: int,
                               concurrency: int) -> float:  # fmt: skip
    """Decisions/s with `concurrency` requests routing at once on one event loop, as the
    router's request flow makes them (`Routing.choose_async`: while one awaits its Redis
    lookup, the others' decisions run)."""
    from router.types import NoWorkerAvailable, Overloaded

    queue = list(reversed(probes))

    async def client() -> None:
        while queue:
            probe = queue.pop()
            with contextlib.suppress(Overloaded, NoWorkerAvailable):  # still a decision
                await routing.choose_async(probe.prompt, max_tokens, set())

    await routing.pool.poll_once()
    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return len(probes) / (time.perf_counter() - start)


def threaded_lookups(index: PrefixIndex, hashes: list[list[int]], threads: int) -> float:
    """Lookups/s from `threads` threads sharing one PrefixIndex: what Redis serves one router."""
    queue = list(reversed(hashes))
    lock = threading.Lock()

    def client() -> None:
        while True:
            with lock:
                if not queue:
                    return
                chain = queue.pop()
            index.lookup(chain)

    workers = [threading.Thread(target=client) for _ in range(threads)]
    start = time.perf_counter()
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    return len(hashes) / (time.perf_counter() - start)
