"""DiskTier: the prefix-cache blocks the host tier evicted, kept in files (--kv-disk-dir,
--kv-disk-gb).

The host tier (host_tier.py) hands a block here when making room would drop it (`put`, the
block's bytes read from its host slot), and a prefix walk that finds a block here reads it into
a staging buffer in host memory and copies it into a free device block (`restore`), as the
issue asks: back to the device through host memory. A file that fails its checks
(disk_block_files.py) is a miss: the block and every block here that extends it are dropped and
recomputed.

Writes leave the engine thread (disk_block_writer.py): `put` queues the block's bytes and the
block is here from then on (a walk reads it from the queue), but the prefix index hears of it
(`stored`, tier `disk`) only once its file is in place (`take_written`); until then it still
counts as the host's. A full queue drops the block rather than wait for the disk, and a write
the file system refuses (a full disk) drops it and every block here that extends it: both are
recomputed later, as without a disk tier.

Capacity is a number of files fixed at start (the budget divided by one file's bytes, header
included): queued blocks hold their slots, and room is made before a block is queued, so the
directory never holds more.
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
    """Where the blocks' bytes are kept (disk_block_writer.BlockFileWriter): `write` queues a
    block, `take_finished` says which writes ended and whether their file is in place; `read`
    returns False when a file failed its checks."""

    write_failures: int
    read_failures: int

    def queue_full(self) -> bool: ...

    def write(self, block_hash: int, payload: BlockBytes) -> None: ...

    def take_finished(self) -> list[tuple[int, bool]]: ...

    def read(self, block_hash: int, out: BlockBytes) -> bool: ...

    def delete(self, block_hash: int) -> None: ...

    def close(self) -> None: ...


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
        self._queued: set[int] = set()  # blocks here whose file is not yet in place
        self.num_written = 0  # blocks whose file was put in place since start
        self.num_dropped = 0  # blocks dropped because the write queue was full
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
        """Queues a block evicted from the host (its parent is held in some tier) for writing;
        returns the events of the blocks evicted from here to make room, or of this one dropped
        when the queue is full. Its own `stored` comes from `take_written`."""
        if self.files.queue_full():
            self.num_dropped += 1
            return self.drop_host_block(block_hash)
        events: list[TierEvent] = []
        while not self.index.free_slots:
            events += self._drop_subtree(self.index.oldest())
        self.index.add(block_hash, token_ids, parent)
        self._queued.add(block_hash)
        self.files.write(block_hash, payload)
        return events

    def drop_host_block(self, block_hash: int) -> list[TierEvent]:
        """A host block leaves every tier: the blocks here that extend it (the host may have
        sent them down before it) go too, leaves first, then it."""
        events: list[TierEvent] = []
        for child in self.index.children(block_hash):
            events += self._drop_subtree(child)
        return [*events, ("removed", block_hash, "host")]

    def take_written(self) -> list[TierEvent]:
        """The events of the writes that ended: a block whose file is in place is stored here;
        one the file system refused is dropped with every block here that extends it."""
        events: list[TierEvent] = []
        for block_hash, written in self.files.take_finished():
            if block_hash not in self._queued:
                continue  # it left this tier while it was written
            if written:
                self._queued.discard(block_hash)
                self.num_written += 1
                events.append(("stored", block_hash, "disk"))
            else:
                events += self._drop_subtree(block_hash)
        return events

    def restore(self, block_hash: int, load: Callable[[BlockBytes], None]) -> list[TierEvent]:
        """Reads the block and hands its bytes to `load` (which copies them to the device), and
        takes it out of this tier; when the file fails its checks, drops it and its descendants
        here instead and returns their removal events (empty on success). A block still queued
        is read from the queue, and not timed: the bandwidth is the disk's."""
        from_disk = block_hash not in self._queued
        started = self._clock()
        if not self.files.read(block_hash, self._staging):
            return self._drop_subtree(block_hash)
        load(self._staging)
        if from_disk:
            self.read_seconds += self._clock() - started
            self.read_bytes += self._staging.numel() * self._staging.element_size()
        self._forget(block_hash)
        self.num_restored += 1
        return []

    def discard(self, block_hash: int) -> None:
        """The device computed and registered this block again: its file is redundant."""
        if block_hash in self.index:
            self._forget(block_hash)

    def close(self) -> None:
        """Stops writing: queued writes are discarded, no temporary file is left."""
        self.files.close()

    def _forget(self, block_hash: int) -> None:
        self.index.forget(block_hash)
        self._queued.discard(block_hash)
        self.files.delete(block_hash)

    def _drop_subtree(self, block_hash: int) -> list[TierEvent]:
        """Leaves first; a block still queued was never announced here: the index has it as
        the host's."""
        events: list[TierEvent] = []
        for h, _ in self.index.evict_subtree(block_hash):
            events.append(("removed", h, "host" if h in self._queued else "disk"))
            self._queued.discard(h)
            self.files.delete(h)
        return events
