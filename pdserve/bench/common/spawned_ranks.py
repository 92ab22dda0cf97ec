"""A tensor-parallel group without Ray: one spawned process per rank, all in one Gloo group on
127.0.0.1 (what a TP worker's rank actors form), for benchmarks and tests that run every rank
of a model themselves."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _in_group(rank: int, size: int, port: int, work: Callable, args: tuple) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # N processes share the machine's cores; `work` may raise it
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size
    )
    try:
        work(rank, size, *args)
        # Every rank done before any tears its group down: rank 0 hosts the group's store, and
        # a rank still talking to it when rank 0 exits dies in a Gloo thread (one full CI run
        # lost a rank to SIGABRT, "terminate called without an active exception").
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_on_ranks(size: int, work: Callable, args: tuple, timeout_s: float = 600) -> None:
    """work(rank, size, *args) in one spawned process per rank, all in one Gloo group (`work`
    importable by module path); raises when a rank raised. Ranks that disagree on a collective
    would wait forever: past `timeout_s` they are killed."""
    import torch.multiprocessing as mp

    context = mp.start_processes(
        _in_group,
        args=(size, free_port(), work, args),
        nprocs=size,
        start_method="spawn",
        join=False,
    )
    deadline = time.monotonic() + timeout_s
    while not context.join(timeout=1):  # raises when a rank failed
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            raise TimeoutError(f"{size} tensor-parallel ranks still running after {timeout_s} s")
