"""TierIndex: which prefix-cache blocks one KV tier below the device holds (host_tier.py,
disk_tier.py), in least recently stored order, with each block's slot in the tier's storage.

Blocks leave a tier three ways: brought back to the device (`forget`: the children stay, their
parent is now on the device), recomputed there (`forget` too), or evicted to make room
(`evict_subtree`: the block with every block of this tier that extends it, so the union of the
tiers stays prefix-closed as the device cache alone is; block_manager.py).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass

from pdserve.core.block_hash import ROOT_HASH
from pdserve.core.kv_events import KVEventKind, KVTier

TierEvent = tuple[KVEventKind, int, KVTier]  # a KV event of one block, as BlockManager queues it


@dataclass
class TierBlock:
    slot: int
    token_ids: tuple[int, ...]
    parent: int  # the parent block's hash (ROOT_HASH for a first block)


class TierIndex:
    def __init__(self, num_slots: int) -> None:
        assert num_slots > 0, "a tier holds at least one block"
        self.num_slots = num_slots
        self._blocks: OrderedDict[int, TierBlock] = OrderedDict()  # hash -> block, LRU first
        self._children: dict[int, set[int]] = {}  # any hash -> blocks here that extend it
        self.free_slots = list(range(num_slots))

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._blocks

    def holds(self, block_hash: int, token_ids: tuple[int, ...]) -> bool:
        """Whether this exact block is here: the hash and, against collisions, its tokens."""
        block = self._blocks.get(block_hash)
        return block is not None and block.token_ids == token_ids

    def items(self) -> Iterator[tuple[int, TierBlock]]:
        """(hash, block) of every block here, least recently stored first."""
        return iter(self._blocks.items())

    def children(self, block_hash: int) -> list[int]:
        """The blocks here that extend `block_hash` (which may be in another tier)."""
        return list(self._children.get(block_hash, ()))

    def oldest(self) -> int:
        return next(iter(self._blocks))

    def add(self, block_hash: int, token_ids: tuple[int, ...], parent: int) -> TierBlock:
        """Takes a free slot (the caller made room) for a new block."""
        assert block_hash not in self._blocks, "a block is in one tier at a time"
        block = TierBlock(self.free_slots.pop(), token_ids, parent)
        self._blocks[block_hash] = block
        if parent != ROOT_HASH:
            self._children.setdefault(parent, set()).add(block_hash)
        return block

    def forget(self, block_hash: int) -> TierBlock:
        """Takes one block out and frees its slot (its children here stay)."""
        block = self._blocks.pop(block_hash)
        siblings = self._children.get(block.parent)
        if siblings is not None:
            siblings.discard(block_hash)
            if not siblings:
                del self._children[block.parent]
        self.free_slots.append(block.slot)
        return block

    def evict_subtree(self, block_hash: int) -> list[tuple[int, TierBlock]]:
        """Takes out a block and every block here that extends it; returns them leaves first
        (so the prefix index never shows a gap). Their slots are free again."""
        order, stack = [], [block_hash]
        while stack:  # every descendant after its parent; not recursive: chains are long
            h = stack.pop()
            order.append(h)
            stack.extend(self._children.get(h, ()))
        return [(h, self.forget(h)) for h in reversed(order)]

    def check_invariants(self) -> None:
        """Asserts slots are owned once and the children map matches (used by tests)."""
        slots = [b.slot for b in self._blocks.values()] + self.free_slots
        assert sorted(slots) == list(range(self.num_slots)), "a slot lost or owned twice"
        for parent, children in self._children.items():
            assert children <= self._blocks.keys()
            assert all(self._blocks[c].parent == parent for c in children)
