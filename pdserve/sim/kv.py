"""The KV of a simulated engine: shapes and byte counts, never the bytes themselves.

`SimKVCache` stands where the torch engine has its cache tensor, with the attributes its users
read (`shape`, `dtype`, `device` = "sim"; kv_transfer's `KVLayout.of` works on it).
`SimulatedKV` is what `read_kv` returns: the transports send its header (shape, dtype, block
ids) with an empty payload, and take `link_seconds` to do so, as the modelled link would.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

SIM_DEVICE = "sim"


@dataclass(frozen=True)
class SimKVCache:
    shape: tuple[int, ...]  # [num_layers, 2, num_blocks, block_size, kv_heads, head_dim]
    dtype: str  # "float32", "bfloat16", "float16"
    itemsize: int
    device: str = SIM_DEVICE

    @property
    def bytes_per_block(self) -> int:
        layers, kv, _, block_size, heads, head_dim = self.shape
        return layers * kv * block_size * heads * head_dim * self.itemsize


@dataclass(frozen=True)
class SimulatedKV:
    """KV chunk `[l1 - l0, 2, n, block_size, kv_heads, head_dim]` that is not held anywhere."""

    shape: tuple[int, ...]
    dtype: str
    itemsize: int
    link_seconds_per_byte: float = 0.0  # wall seconds the modelled link takes per byte

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize

    @property
    def link_seconds(self) -> float:
        """How long sending these bytes takes on the modelled link (time scale applied)."""
        return self.nbytes * self.link_seconds_per_byte
