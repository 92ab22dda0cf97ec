"""KVEvent: what the engine tells the prefix index about its cache (no torch import here).

"stored": full blocks whose hashes were just registered in the prefix cache, in `tier`: the
device pool, the host tier (--kv-offload-gb) for a block the device evicted into it, or the
disk tier (--kv-disk-dir) for a block the host tier evicted into it. A block
that moves between tiers is stored again with its new tier: an update, not a removal.
"removed": cached blocks that were evicted from `tier` and whose contents are gone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

KVEventKind = Literal["stored", "removed"]
KVTier = Literal["device", "host", "disk"]
KV_TIERS: tuple[KVTier, ...] = ("device", "host", "disk")


@dataclass(frozen=True)
class KVEvent:
    kind: KVEventKind
    block_hashes: list[int]
    token_count: int  # tokens covered by these blocks (len(block_hashes) * block_size)
    tier: KVTier = "device"


KVEventSink = Callable[[list[KVEvent]], None]
