"""HostKVPool: the bytes of the host tier (host_tier.py), a copy of device KV blocks in RAM.

On CUDA the pool is pinned memory and every copy runs on a side stream with non_blocking set,
so evicting or restoring a block does not wait for the device: the side stream first waits for
the work already queued on the engine's stream (which wrote the block), and `fence` makes the
engine's stream wait for the copies before anything that could overwrite or read those blocks
runs (the next step's forward, copy-on-write copies, a KV transfer into reserved blocks). On
CPU the copies are plain and `fence` has nothing to do.
"""

from __future__ import annotations

import time

import torch

from pdserve.engine.disk_block_files import DiskBlockFiles
from pdserve.engine.disk_block_writer import BlockFileWriter
from pdserve.engine.disk_tier import DiskTier
from pdserve.engine.host_tier import HostTier

# Host memory for the disk tier's queued writes, on top of the host tier's budget: blocks the
# host evicts faster than the disk takes them beyond this are dropped (recomputed later).
WRITE_QUEUE_BYTES = 64 * 2**20


def make_host_tier(
    kv_cache: torch.Tensor,
    budget_bytes: int,
    disk_dir: str | None = None,
    disk_bytes: int = 0,
    write_queue_bytes: int = WRITE_QUEUE_BYTES,
) -> HostTier | None:
    """A host tier of as many whole blocks of `kv_cache` as `budget_bytes` holds (never more),
    over a disk tier in `disk_dir` of as many block files as `disk_bytes` holds, its writes
    queued in up to `write_queue_bytes` (at least one block); None when not even one block
    fits in host memory (no disk tier without a host tier: blocks reach the disk through
    it)."""
    per_block = kv_cache[:, :, 0].numel() * kv_cache.element_size()
    slots = budget_bytes // per_block
    if not slots:
        return None
    pool = HostKVPool(kv_cache, slots)
    disk_slots = disk_bytes // DiskBlockFiles.file_bytes(per_block) if disk_dir else 0
    disk = None
    if disk_slots:
        staging = torch.empty(pool.blocks.shape[1:], dtype=kv_cache.dtype, pin_memory=pool.cuda)
        writer = BlockFileWriter(DiskBlockFiles(disk_dir), max(1, write_queue_bytes // per_block))
        disk = DiskTier(writer, disk_slots, staging)
    return HostTier(pool, slots, disk)


class HostKVPool:
    """Slots of whole blocks in host memory, for a device pool `kv_cache` of shape
    [num_layers, 2, num_blocks, block_size, kv_heads, head_dim]."""

    def __init__(self, kv_cache: torch.Tensor, num_slots: int) -> None:
        self.kv_cache = kv_cache
        self.cuda = cuda = kv_cache.is_cuda
        layers, kv, _, block_size, heads, head_dim = kv_cache.shape
        # [num_slots, num_layers, 2, block_size, kv_heads, head_dim]: slot-major, so one slot
        # is contiguous and a device-to-host copy of it is one transfer into pinned memory.
        self.blocks = torch.empty(
            (num_slots, layers, kv, block_size, heads, head_dim),
            dtype=kv_cache.dtype,
            pin_memory=cuda,
        )
        self._stream = torch.cuda.Stream(kv_cache.device) if cuda else None
        self.bytes_per_s = self._measure_load_bandwidth()

    @property
    def nbytes(self) -> int:
        return self.blocks.numel() * self.blocks.element_size()

    def save(self, block_id: int, slot: int) -> None:
        if self._stream is None:
            self.blocks[slot].copy_(self.kv_cache[:, :, block_id])
            return
        self._stream.wait_stream(torch.cuda.current_stream(self.kv_cache.device))
        with torch.cuda.stream(self._stream):
            self.blocks[slot].copy_(self.kv_cache[:, :, block_id], non_blocking=True)

    def load(self, slot: int, block_id: int) -> None:
        if self._stream is None:
            self.kv_cache[:, :, block_id].copy_(self.blocks[slot])
            return
        self._stream.wait_stream(torch.cuda.current_stream(self.kv_cache.device))
        with torch.cuda.stream(self._stream):
            self.kv_cache[:, :, block_id].copy_(self.blocks[slot], non_blocking=True)

    def host_block(self, slot: int) -> torch.Tensor:
        if self._stream is not None:
            self._stream.synchronize()  # the slot's save may still be in flight
        return self.blocks[slot]

    def load_from(self, data: torch.Tensor, block_id: int) -> None:
        # Blocking: `data` is a staging buffer the next read overwrites.
        self.kv_cache[:, :, block_id].copy_(data)

    def _measure_load_bandwidth(self, repeats: int = 3) -> int:
        """Host-to-device bytes per second of copying blocks back, the best of a few copies of
        up to 32 slots (at start, while the pool is unused): what the router prices a host hit
        at (router/cost_model.py)."""
        n = min(len(self.blocks), 32)
        target = torch.empty((n, *self.blocks.shape[1:]), dtype=self.blocks.dtype)
        target = target.to(self.kv_cache.device)
        best = float("inf")
        for _ in range(repeats):
            started = time.perf_counter()
            target.copy_(self.blocks[:n], non_blocking=True)
            if self.kv_cache.is_cuda:
                torch.cuda.synchronize(self.kv_cache.device)
            best = min(best, time.perf_counter() - started)
        return int(target.numel() * target.element_size() / max(best, 1e-9))

    def fence(self) -> None:
        if self._stream is not None:
            torch.cuda.current_stream(self.kv_cache.device).wait_stream(self._stream)
