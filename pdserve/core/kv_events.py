"""KVEvent: what the engine tells the prefix index about its cache (no torch import here).

"stored": full blocks whose hashes were just registered in the prefix cache.
"removed": cached blocks that were evicted and whose contents are gone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

KVEventKind = Literal["stored", "removed"]


@dataclass(frozen=True)
class KVEvent:
    kind: KVEventKind
    block_hashes: list[int]
    token_count: int  # tokens covered by these blocks (len(block_hashes) * block_size)


KVEventSink = Callable[[list[KVEvent]], None]
