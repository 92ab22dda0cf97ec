"""`pdserve bench disk-demotion`: what demoting a block from the host tier to the disk tier
costs the engine thread, with the file written there (as before issue 53's writer thread) and
queued to the writer thread (disk_block_writer.py), same blocks, same run.

    pdserve bench disk-demotion [--block-kib 8,256,2048] [--blocks 200] [--dir DIR]

A host tier of a few slots over a disk tier (make_host_tier, files in --dir, a temporary
directory by default) takes --blocks distinct blocks from a CPU "device" pool, one every
--interval-ms (the engine's steps between evictions; 0: back to back), so each offload past the
host's slots demotes one block to the disk. Timed: each `DiskTier.put` call, the whole of a
demotion on the engine thread (making room, and the write or the queueing with its one copy).
The synchronous way runs the same DiskTier over the real files written in the call. Reported
per block size: the engine thread's time per demotion (mean, p50, p99), the ratio of the
writer-thread way's mean over the synchronous way's, the blocks the writer way dropped because
its queue was full, and how long its queue took to drain after the last demotion.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

BLOCK_SIZE = 16  # tokens per block; the pool's head count sets a block's bytes
HOST_SLOTS = 4


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--block-kib",
        default="8,256,2048",
        help="block sizes in KiB, comma-separated (tiny's block of 16 tokens is 8 KiB; an 8B "
        "model's, fp16, is 2048)",
    )
    p.add_argument("--blocks", type=int, default=200, help="blocks demoted per way and size")
    p.add_argument("--interval-ms", type=float, default=1.0, help="between two demotions")
    p.add_argument("--dir", help="where the block files go (default: a temporary directory)")


@dataclass
class Demotions:
    """One way's demotions of one block size."""

    seconds: list[float]  # the engine thread's time in each DiskTier.put
    dropped: int  # blocks the writer's full queue dropped
    drain_seconds: float  # after the last demotion, until every queued write ended

    def mean_us(self) -> float:
        return statistics.fmean(self.seconds) * 1e6

    def quantile_us(self, q: float) -> float:
        ordered = sorted(self.seconds)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e6


class SynchronousFiles:
    """The disk tier's files written on the calling thread: every write ends in `write`."""

    def __init__(self, files) -> None:
        self.files = files
        self._finished: list[tuple[int, bool]] = []

    @property
    def write_failures(self) -> int:
        return self.files.write_failures

    @property
    def read_failures(self) -> int:
        return self.files.read_failures

    def queue_full(self) -> bool:
        return False

    def write(self, block_hash: int, payload) -> None:
        self._finished.append((block_hash, self.files.write(block_hash, payload)))

    def take_finished(self) -> list[tuple[int, bool]]:
        finished, self._finished = self._finished, []
        return finished

    def read(self, block_hash: int, out) -> bool:
        return self.files.read(block_hash, out)

    def delete(self, block_hash: int) -> None:
        self.files.delete(block_hash)

    def wait_idle(self) -> bool:
        return True

    def close(self) -> None:
        """Nothing runs in the background."""


def demote(
    block_kib: int, blocks: int, interval_s: float, base_dir: str, synchronous: bool
) -> Demotions:
    import torch

    from pdserve.engine.disk_block_files import DiskBlockFiles
    from pdserve.engine.host_kv_pool import make_host_tier

    heads = block_kib * 1024 // (2 * BLOCK_SIZE * 64 * 4)  # [1 layer, K and V, 16, heads, 64] fp32
    kv = torch.randn(1, 2, 8, BLOCK_SIZE, heads, 64)
    per_block = kv[:, :, 0].numel() * kv.element_size()
    tier = make_host_tier(
        kv, HOST_SLOTS * per_block, base_dir, (blocks + 1) * DiskBlockFiles.file_bytes(per_block)
    )
    assert tier is not None and tier.disk is not None
    disk = tier.disk
    if synchronous:
        disk.files.close()
        disk.files = SynchronousFiles(disk.files.files)
    seconds: list[float] = []
    disk.put = _timed(disk.put, seconds)
    for i in range(blocks + HOST_SLOTS):
        # Distinct first blocks (parent: the root), so each is demoted whole.
        tier.offload(i % kv.shape[2], 1000 + i, (i,), 0)
        tier.take_written()
        time.sleep(interval_s)
    started = time.perf_counter()
    assert disk.files.wait_idle()
    drain = time.perf_counter() - started
    tier.take_written()
    tier.close()
    return Demotions(seconds, disk.num_dropped, drain)


def _timed(fn: Callable, into: list[float]) -> Callable:
    def timed(*args, **kwargs):
        started = time.perf_counter()
        result = fn(*args, **kwargs)
        into.append(time.perf_counter() - started)
        return result

    return timed


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=150)
    table = Table(title=f"engine-thread time per demotion, {args.blocks} blocks each")
    for column in (
        "block",
        "way",
        "mean us",
        "p50 us",
        "p99 us",
        "dropped",
        "drain ms",
        "writer / synchronous (mean)",
    ):
        table.add_column(column)
    for kib in (int(k) for k in args.block_kib.split(",")):
        results = {}
        for way, synchronous in (("synchronous", True), ("writer thread", False)):
            with tempfile.TemporaryDirectory(prefix="pdserve-demotion-", dir=args.dir) as base:
                results[way] = demote(kib, args.blocks, args.interval_ms / 1e3, base, synchronous)
        ratio = results["writer thread"].mean_us() / results["synchronous"].mean_us()
        for way, r in results.items():
            table.add_row(
                f"{kib} KiB",
                way,
                f"{r.mean_us():.1f}",
                f"{r.quantile_us(0.5):.1f}",
                f"{r.quantile_us(0.99):.1f}",
                str(r.dropped),
                f"{r.drain_seconds * 1e3:.1f}",
                f"{ratio:.3f}" if way == "writer thread" else "",
            )
    console.print(table)
    return 0
