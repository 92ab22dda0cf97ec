"""HostTier: the prefix-cache blocks the device pool evicted, kept in host memory (--kv-offload-gb).

The BlockManager hands a block here when it would drop it from its prefix cache
(`offload`), and takes it back into a free device block when a prefix walk misses the device
cache but finds the block here (`restore`); the bytes move through a `BlockCopier`
(host_kv_pool.HostKVPool). A block is in at most one tier: restoring takes it out of the host,
and a block the device computes again and registers is dropped from here (`discard`).

The union of both tiers stays prefix-closed, as the device cache alone is (block_manager.py):
a block enters the host while its parent is still cached on the device (the device evicts
leaves first), and making room here evicts a block together with every host block that extends
it, leaves first. So the prefix index may still bisect a worker's holdings.

Capacity is a number of slots fixed at start (the budget divided by one block's bytes): the
tier never holds more, and evicts least recently used blocks to take a new one.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Protocol

from pdserve.core.block_hash import ROOT_HASH


def host_tier_stats(tier: HostTier | None) -> dict[str, int]:
    """The engine's stats of its host tier (zeros without one)."""
    return {
        "num_host_blocks": tier.num_slots if tier else 0,
        "num_host_cached_blocks": len(tier) if tier else 0,
        "host_offloaded_blocks": tier.num_offloaded if tier else 0,
        "host_restored_blocks": tier.num_restored if tier else 0,
        "host_copy_bytes_per_s": tier.copier.bytes_per_s if tier else 0,
    }


class BlockCopier(Protocol):
    """Moves one block's KV (every layer) between the device pool and a host slot. Copies are
    ordered as they are called; `fence` makes later device work wait for them.
    `bytes_per_s`: host-to-device copy bandwidth, measured when it was made."""

    bytes_per_s: int

    def save(self, block_id: int, slot: int) -> None: ...

    def load(self, slot: int, block_id: int) -> None: ...

    def fence(self) -> None: ...


@dataclass
class _HostBlock:
    slot: int
    token_ids: tuple[int, ...]
    parent: int  # the parent block's hash (ROOT_HASH for a first block)


class HostTier:
    def __init__(self, copier: BlockCopier, num_slots: int) -> None:
        assert num_slots > 0, "a host tier holds at least one block"
        self.copier = copier
        self.num_slots = num_slots
        self._blocks: OrderedDict[int, _HostBlock] = OrderedDict()  # hash -> block, LRU first
        self._children: dict[int, set[int]] = {}  # any hash -> host blocks that extend it
        self._free_slots = list(range(num_slots))
        self.num_offloaded = 0  # blocks copied here since start
        self.num_restored = 0  # blocks copied back to the device since start

    def __len__(self) -> int:
        return len(self._blocks)

    def holds(self, block_hash: int, token_ids: tuple[int, ...]) -> bool:
        """Whether this exact block is here: the hash and, against collisions, its tokens."""
        block = self._blocks.get(block_hash)
        return block is not None and block.token_ids == token_ids

    def offload(
        self, block_id: int, block_hash: int, token_ids: tuple[int, ...], parent: int
    ) -> list[int]:
        """Copies device block `block_id` here under its hash; returns the hashes evicted from
        the host to make room, leaves first (their contents are gone)."""
        assert block_hash not in self._blocks, "a block is in one tier at a time"
        evicted: list[int] = []
        while not self._free_slots:
            evicted += self._evict(next(iter(self._blocks)))
        slot = self._free_slots.pop()
        self.copier.save(block_id, slot)
        self._blocks[block_hash] = _HostBlock(slot, token_ids, parent)
        if parent != ROOT_HASH:
            self._children.setdefault(parent, set()).add(block_hash)
        self.num_offloaded += 1
        return evicted

    def restore(self, block_hash: int, block_id: int) -> None:
        """Copies the block back into device block `block_id` and takes it out of this tier
        (its host children stay: their parent is now on the device)."""
        block = self._forget(block_hash)
        self.copier.load(block.slot, block_id)
        self._free_slots.append(block.slot)
        self.num_restored += 1

    def discard(self, block_hash: int) -> None:
        """The device computed and registered this block again: its host copy is redundant."""
        if block_hash in self._blocks:
            self._free_slots.append(self._forget(block_hash).slot)

    def _evict(self, block_hash: int) -> list[int]:
        """Drops a block and every host block that extends it; returns their hashes, leaves
        first (so the prefix index never shows a gap)."""
        order, stack = [], [block_hash]
        while stack:  # every descendant after its parent; not recursive: chains are long
            h = stack.pop()
            order.append(h)
            stack.extend(self._children.get(h, ()))
        order.reverse()
        for h in order:
            self._free_slots.append(self._forget(h).slot)
        return order

    def _forget(self, block_hash: int) -> _HostBlock:
        block = self._blocks.pop(block_hash)
        siblings = self._children.get(block.parent)
        if siblings is not None:
            siblings.discard(block_hash)
            if not siblings:
                del self._children[block.parent]
        return block

    def check_invariants(self) -> None:
        """Asserts slots are owned once and the children map matches (used by tests)."""
        slots = [b.slot for b in self._blocks.values()] + self._free_slots
        assert sorted(slots) == list(range(self.num_slots)), "a slot lost or owned twice"
        for parent, children in self._children.items():
            assert children <= self._blocks.keys()
            assert all(self._blocks[c].parent == parent for c in children)
