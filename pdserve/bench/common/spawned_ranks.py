"""A tensor-parallel group without Ray: one spawned process per rank, all in one Gloo group on
127.0.0.1 (what a TP worker's rank actors form), for benchmarks and tests that run every rank
of a model themselves."""

from __future__ import annotations

import faulthandler
import os
import socket
import sys
import time
from collections.abc import Callable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _in_group(rank: int, size: int, port: int, work: Callable, args: tuple) -> None:
    import torch
    import torch.distributed as dist

    # A rank that dies of a signal prints every thread's Python stack: a SIGABRT from a C++
    # thread says nothing else about where the rank was.
    faulthandler.enable(all_threads=True)
    torch.set_num_threads(1)  # N processes share the machine's cores; `work` may raise it
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size
    )
    try:
        work(rank, size, *args)
        # Every rank done before any tears its group down: rank 0 hosts the group's store.
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # The rank's work is done and written, and its group torn down; what is left is the
    # interpreter's teardown, which destroys torch's C++ state (Gloo's and the store's threads)
    # in an order the rank does not control. Three full CI runs lost a rank to SIGABRT,
    # "terminate called without an active exception", the message of a std::thread destroyed
    # unjoined (pytorch/pytorch#190489 reports it from Gloo at exit); the logs did not say
    # where, and here it came back once in ~55 runs of `bench moe-tp`'s test. Ending the
    # process here rules teardown out; faulthandler (above) shows the stack if it was not.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


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
