"""HostTier: the prefix-cache blocks the device pool evicted, kept in host memory (--kv-offload-gb).

The BlockManager hands a block here when it would drop it from its prefix cache
(`offload`), and takes it back into a free device block when a prefix walk misses the device
cache but finds the block here (`restore`); the bytes move through a `BlockCopier`
(host_kv_pool.HostKVPool). A block is in at most one tier: restoring takes it out of the host,
and a block the device computes again and registers is dropped from here (`discard`).

With a disk tier (disk_tier.py, --kv-disk-dir) the blocks this tier evicts are written there
instead of dropped, and a walk that finds a block there reads it back to the device.

The union of the tiers stays prefix-closed, as the device cache alone is (block_manager.py):
a block enters the host while its parent is still cached on the device (the device evicts
leaves first), and making room here evicts a block together with every host block that extends
it, leaves first. So a host block's parent is always on the device or here, never on the disk,
and a disk block's descendants are all on the disk: the disk evicting a block with its disk
descendants leaves no gap either. So the prefix index may still bisect a worker's holdings.

Capacity is a number of slots fixed at start (the budget divided by one block's bytes): the
tier never holds more, and evicts least recently stored blocks to take a new one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from pdserve.core.kv_events import KVTier
from pdserve.engine.tier_index import TierIndex

if TYPE_CHECKING:
    from pdserve.engine.disk_tier import BlockBytes, DiskTier
    from pdserve.engine.tier_index import TierEvent


def host_tier_stats(tier: HostTier | None) -> dict[str, int]:
    """The engine's stats of its host and disk tiers (zeros without them)."""
    return {
        "num_host_blocks": tier.num_slots if tier else 0,
        "num_host_cached_blocks": len(tier) if tier else 0,
        "host_offloaded_blocks": tier.num_offloaded if tier else 0,
        "host_restored_blocks": tier.num_restored if tier else 0,
        "host_copy_bytes_per_s": tier.copier.bytes_per_s if tier else 0,
        **disk_tier_stats(tier.disk if tier else None),
    }


def disk_tier_stats(disk: DiskTier | None) -> dict[str, int]:
    return {
        "num_disk_blocks": disk.index.num_slots if disk else 0,
        "num_disk_cached_blocks": len(disk) if disk else 0,
        "disk_written_blocks": disk.num_written if disk else 0,
        "disk_dropped_blocks": disk.num_dropped if disk else 0,
        "disk_restored_blocks": disk.num_restored if disk else 0,
        "disk_write_failures": disk.files.write_failures if disk else 0,
        "disk_read_failures": disk.files.read_failures if disk else 0,
        "disk_read_bytes_per_s": disk.read_bytes_per_s if disk else 0,
    }


class BlockCopier(Protocol):
    """Moves one block's KV (every layer) between the device pool and a host slot. Copies are
    ordered as they are called; `fence` makes later device work wait for them.
    `bytes_per_s`: host-to-device copy bandwidth, measured when it was made."""

    bytes_per_s: int

    def save(self, block_id: int, slot: int) -> None: ...

    def load(self, slot: int, block_id: int) -> None: ...

    def host_block(self, slot: int) -> BlockBytes:
        """A slot's bytes in host memory, once the copies into it have landed."""
        ...

    def load_from(self, data: BlockBytes, block_id: int) -> None:
        """Copies one block's bytes from host memory (shaped as a slot) to the device."""
        ...

    def fence(self) -> None: ...


class HostTier:
    def __init__(self, copier: BlockCopier, num_slots: int, disk: DiskTier | None = None) -> None:
        self.copier = copier
        self.index = TierIndex(num_slots)
        self.disk = disk  # where evicted blocks go instead of being dropped (--kv-disk-dir)
        self.num_offloaded = 0  # blocks copied here since start
        self.num_restored = 0  # blocks copied back to the device since start

    @property
    def num_slots(self) -> int:
        return self.index.num_slots

    def __len__(self) -> int:
        return len(self.index)

    def holds(self, block_hash: int, token_ids: tuple[int, ...]) -> bool:
        """Whether this exact block is here or on the disk below (hash and tokens)."""
        return self.index.holds(block_hash, token_ids) or (
            self.disk is not None and self.disk.index.holds(block_hash, token_ids)
        )

    def offload(
        self, block_id: int, block_hash: int, token_ids: tuple[int, ...], parent: int
    ) -> list[TierEvent]:
        """Copies device block `block_id` here under its hash; returns the events: blocks
        moved to the disk or dropped to make room, then this block stored here."""
        events: list[TierEvent] = []
        while not self.index.free_slots:
            events += self._evict(self.index.oldest())
        slot = self.index.add(block_hash, token_ids, parent).slot
        self.copier.save(block_id, slot)
        self.num_offloaded += 1
        return [*events, ("stored", block_hash, "host")]

    def restore(self, block_hash: int, block_id: int) -> tuple[KVTier | None, list[TierEvent]]:
        """Copies the block back into device block `block_id` from this tier or the disk, and
        takes it out of there (its children stay: their parent is now on the device). Returns
        the tier it came from, or None when its file failed its checks (the device block is
        then garbage), and the events of the blocks that left the disk with it."""
        if block_hash in self.index:
            self.copier.load(self.index.forget(block_hash).slot, block_id)
            self.num_restored += 1
            return "host", []
        assert self.disk is not None
        events = self.disk.restore(block_hash, lambda data: self.copier.load_from(data, block_id))
        return (None if events else "disk"), events

    def take_written(self) -> list[TierEvent]:
        """The events of the disk writes that ended since the last call (disk_tier.py)."""
        return self.disk.take_written() if self.disk is not None else []

    def close(self) -> None:
        """Stops the disk tier's writer (queued writes are discarded)."""
        if self.disk is not None:
            self.disk.close()

    def discard(self, block_hash: int) -> None:
        """The device computed and registered this block again: a copy below is redundant."""
        if block_hash in self.index:
            self.index.forget(block_hash)
        elif self.disk is not None:
            self.disk.discard(block_hash)

    def _evict(self, block_hash: int) -> list[TierEvent]:
        """Makes room: a block and every host block that extends it go to the disk, parents
        first, a block only if its parent is still held (on the device, here, or written to the
        disk); the others are dropped."""
        # Leaves first. Their slots are free again but keep their bytes until this returns:
        # nothing is saved into a slot before then (`offload` saves after making room).
        gone = self.index.evict_subtree(block_hash)
        moving = {h for h, _ in gone}
        events: list[TierEvent] = []
        for h, block in reversed(gone):
            parent_held = block.parent not in moving or (
                self.disk is not None and block.parent in self.disk.index
            )
            if self.disk is None:
                events.append(("removed", h, "host"))
            elif parent_held:
                payload = self.copier.host_block(block.slot)
                events += self.disk.put(h, block.token_ids, block.parent, payload)
            else:
                events += self.disk.drop_host_block(h)
        return events

    def check_invariants(self) -> None:
        """Asserts slots are owned once and the children maps match (used by tests)."""
        self.index.check_invariants()
        if self.disk is not None:
            self.disk.index.check_invariants()
