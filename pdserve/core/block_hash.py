"""THE chained block hash: the engine, the router and the prefix index all use this one.

A full KV block is named by hash(parent block's hash, the block's token ids). Chaining makes a
block's name depend on the whole prefix before it, so equal names mean equal prefixes. The hash
is blake2b over a fixed byte encoding: identical across processes, runs and machines (Python's
built-in `hash()` is salted per process and must never be used here).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

# The parent hash of a sequence's first block. Part of the wire contract with the index.
ROOT_HASH = 0
_MASK = (1 << 63) - 1  # keep hashes positive and inside a signed 64-bit integer (Redis, protobuf)
_PARENT = struct.Struct("<q")


def block_hash(parent_hash: int, token_ids: Sequence[int]) -> int:
    """Hash of one full block given its parent's hash (ROOT_HASH for the first block)."""
    return _chain(parent_hash, struct.pack(f"<{len(token_ids)}I", *token_ids))


def _chain(
    parent_hash: int,
    packed_tokens: bytes,
    blake2b=hashlib.blake2b,
    pack_parent=_PARENT.pack,
    from_bytes=int.from_bytes,
) -> int:
    # The defaults bind the callees once: the router chains 256 blocks per 4096-token prompt.
    # (One buffer hashed at once is the same digest as the parent then the tokens, fewer calls.)
    digest = blake2b(pack_parent(parent_hash) + packed_tokens, digest_size=8).digest()
    return from_bytes(digest, "little") & _MASK


def prompt_block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """Chained hashes of every *full* block of `token_ids`; a trailing partial block has none."""
    full = len(token_ids) // block_size * block_size
    # Every full block's tokens packed at once: the router hashes each prompt it routes. (Bytes
    # slices of a block are cheaper to take than memoryview ones.)
    packed = struct.pack(f"<{full}I", *token_ids[:full])
    step = 4 * block_size
    hashes: list[int] = []
    parent = ROOT_HASH
    for start in range(0, len(packed), step):
        parent = _chain(parent, packed[start : start + step])
        hashes.append(parent)
    return hashes
