"""DiskTier: the prefix-cache blocks the host tier evicted, kept in files (--kv-disk-dir,
--kv-disk-gb).

The host tier (host_tier.py) hands a block here when making room would drop it (`put`, the
block's bytes read from its host slot), and a prefix walk that finds a block here reads it into
a staging buffer in host memory and copies it into a free device block (`restore`), as the
issue asks: back to the device through host memory. A file that fails its checks
(disk_block_files.py) is a miss: the block and every block here that extends it are dropped and
recomputed. A write the file system refuses (a full disk) drops the block as if there were no
disk tier.

Capacity is a number of files fixed at start (the budget divided by one file's bytes, header
included): the directory never holds more, as room is made before a file is written.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

from pdserve.engine.tier_index import TierEvent, TierIndex

# One block's bytes in host memory: a contiguous CPU torch.Tensor shaped as a host slot. Not
# imported: the offline planner imports the engine, and with it this module, without torch.
BlockBytes = Any


class BlockFiles(Protocol):
    """Where the blocks' bytes are kept (disk_block_files.DiskBlockFiles): `write` and `read`
    return False when the file system refused or a file failed its checks."""

    write_failures: int
    read_failures: int

    def write(self, block_hash: int, payload: BlockBytes) -> bool: ...

    def read(self, block_hash: int, out: BlockBytes) -> bool: ...

    def delete(self, block_hash: int) -> None: ...


class DiskTier:
    def __init__(
        self,
        files: BlockFiles,
        num_slots: int,
        staging: BlockBytes,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        """`staging`: one block's bytes in host memory (pinned on CUDA), shaped as a host slot.
        `clock`: what reads are timed by (a sim worker's modelled transfer time)."""
        self.files = files
        self._clock = clock
        self.index = TierIndex(num_slots)
        self._staging = staging
        self.num_written = 0  # blocks stored here since start
        self.num_restored = 0  # blocks read back to the device since start
        self.read_bytes = 0
        self.read_seconds = 0.0

    def __len__(self) -> int:
        return len(self.index)

    @property
    def read_bytes_per_s(self) -> int:
        """Mean bandwidth of reading blocks back (file to device), 0 before the first."""
        return int(self.read_bytes / self.read_seconds) if self.read_seconds else 0

    def put(
        self, block_hash: int, token_ids: tuple[int, ...], parent: int, payload: BlockBytes
    ) -> list[TierEvent]:
        """Writes a block evicted from the host (its parent is held in some tier); returns the
        events: blocks evicted from here to make room, and this one stored unless the write
        failed (then it is gone)."""
        events: list[TierEvent] = []
        while not self.index.free_slots:
            events += self._drop_subtree(self.index.oldest())
        if not self.files.write(block_hash, payload):
            return [*events, ("removed", block_hash, "host")]
        self.index.add(block_hash, token_ids, parent)
        self.num_written += 1
        return [*events, ("stored", block_hash, "disk")]

    def restore(self, block_hash: int, load: Callable[[BlockBytes], None]) -> list[TierEvent]:
        """Reads the block and hands its bytes to `load` (which copies them to the device), and
        takes it out of this tier; when the file fails its checks, drops it and its descendants
        here instead and returns their removal events (empty on success)."""
        started = self._clock()
        if not self.files.read(block_hash, self._staging):
            return self._drop_subtree(block_hash)
        load(self._staging)
        self.read_seconds += self._clock() - started
        self.read_bytes += self._staging.numel() * self._staging.element_size()
        self.index.forget(block_hash)
        self.files.delete(block_hash)
        self.num_restored += 1
        return []

    def discard(self, block_hash: int) -> None:
        """The device computed and registered this block again: its file is redundant."""
        if block_hash in self.index:
            self.index.forget(block_hash)
            self.files.delete(block_hash)

    def _drop_subtree(self, block_hash: int) -> list[TierEvent]:
        gone = self.index.evict_subtree(block_hash)
        for h, _ in gone:
            self.files.delete(h)
        return [("removed", h, "disk") for h, _ in gone]
